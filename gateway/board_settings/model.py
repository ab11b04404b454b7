"""The per-board settings file, sans I/O: parse it, merge it over the image's configuration, write TOML.

The file (``edge-gateway-settings.toml`` at the root of the boot partition; README "Per-board settings")::

    gateway_id = "gw-harbour-07"             # sets [gateway] broker.gateway_id and [bridge] bridge.gateway_id

    [gateway.listeners.external]             # merged over the image's /etc/edge-gateway/gateway.toml
    bind = "0.0.0.0:8883"
    certfile = "{settings}/server.crt"       # a file of [files] below, installed for the broker
    keyfile = "{settings}/server.key"
    password_file = "{settings}/passwd"

    [[gateway.upstream]]                     # an array replaces the image's array
    name = "cloud"
    url = "mqtts://mqtt.example.net:8883"

    [[bridge.ports]]                         # merged over the image's /etc/firmware-bridge/bridge.toml
    path = "/dev/ttyUSB0"

    [files]                                  # file name -> its text
    "server.key" = '''
    -----BEGIN PRIVATE KEY-----
    ...'''

    [access]
    ssh_authorized_keys = ["ssh-ed25519 AAAA... op@laptop"]

Tables merge key by key, recursively; any other value (a string, a number, an array such as ``[[gateway.upstream]]``
or ``[[bridge.ports]]``) replaces the image's. What the merged files mean is checked afterwards by the loaders
``check-config`` uses (:mod:`gateway.board_settings.install`); this module checks only the file's own shape.
"""

from __future__ import annotations

import base64
import binascii
import copy
import datetime
import hashlib
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

SETTINGS_FILE = "edge-gateway-settings.toml"
#: A string of ``[gateway]`` that is exactly ``{settings}/NAME`` becomes the installed path of ``[files] NAME``.
PLACEHOLDER = "{settings}"
TOP_KEYS = ("access", "bridge", "files", "gateway", "gateway_id")
FILE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
FILE_NAME_ALLOWED = "1-64 letters, digits, '.', '_' or '-', not starting with '.', '_' or '-'"
MAX_FILE_BYTES = 1024 * 1024
#: OpenSSH public key types an operator key may have (sshd(8) "AUTHORIZED_KEYS FILE FORMAT").
SSH_KEY_TYPES = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "ssh-rsa",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
)
SECRET_MARK = "<secret>"
# upstream password = "...", and any key named or ending so (not password_file: a path)
_SECRET_KEY = re.compile(r"(^|_)(password|secret|token)$", re.IGNORECASE)


class SettingsError(Exception):
    """The settings cannot be applied; ``errors`` holds one line per mistake, each naming the key, the value (never
    a secret's) and what is allowed."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("; ".join(errors))


@dataclass(frozen=True, slots=True)
class BoardSettings:
    """A parsed settings file.

    Attributes:
        gateway: the ``[gateway]`` table (with ``gateway_id`` folded in), merged over the image's gateway.toml.
        bridge: the ``[bridge]`` table (likewise), merged over the image's bridge.toml.
        files: ``[files]``: file name -> text (ends with a newline).
        ssh_authorized_keys: ``[access] ssh_authorized_keys``: one OpenSSH public key line each; empty: no SSH.
    """

    gateway: dict[str, Any] = field(default_factory=dict)
    bridge: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    ssh_authorized_keys: tuple[str, ...] = ()

    def secrets(self) -> list[str]:
        """Every text that must not reach a log: the lines of ``[files]`` (but PEM armour lines), every string
        under a key named ``password``, ``secret`` or ``token`` (or ending ``_password``, ...), and the password of
        a URL. Longest first."""
        found: set[str] = set()
        for text in self.files.values():
            found.update(line.strip() for line in text.splitlines()
                         if len(line.strip()) >= 6 and not line.startswith("-----"))
        _collect_secrets(self.gateway, found)
        _collect_secrets(self.bridge, found)
        return sorted(found, key=len, reverse=True)


@dataclass(frozen=True, slots=True)
class Plan:
    """What one application of the settings installs (the caller writes it; paths are in ``files_dir``).

    Attributes:
        gateway: the merged gateway.toml as data (``{settings}/NAME`` expanded to ``files_dir/NAME``).
        bridge: the merged bridge.toml as data, or ``None`` when the image has no bridge.toml and ``[bridge]``
            is absent.
        files: ``[files]`` as they are.
        authorized_keys: the text of the operator's authorized_keys file, or ``None`` (no SSH server).
    """

    gateway: dict[str, Any]
    bridge: dict[str, Any] | None
    files: dict[str, str]
    authorized_keys: str | None


def parse_settings(text: str) -> BoardSettings:
    """Parse a settings file's text and check its shape (the top-level keys, ``[files]``, ``[access]``).

    Raises:
        SettingsError: not TOML, or every mistake of shape, each naming the key, the value and what is allowed.
    """
    settings, errors = read_settings(text)
    if errors:
        raise SettingsError(errors)
    return settings


def read_settings(text: str) -> tuple[BoardSettings, list[str]]:
    """As :func:`parse_settings`, but the mistakes of shape are returned with what could be read (a bad file of
    ``[files]`` or key of ``[access]`` left out), so that the merged configuration is checked too and a file's every
    mistake is reported at once.

    Raises:
        SettingsError: the text is not TOML.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError([f"not valid TOML: {exc}"]) from None
    errors: list[str] = []
    for key in data:
        if key not in TOP_KEYS:
            errors.append(f"{key}: unknown key; allowed: {', '.join(TOP_KEYS)}")
    tables: dict[str, dict[str, Any]] = {}
    for name in ("gateway", "bridge", "files", "access"):
        value = data.get(name, {})
        if not isinstance(value, dict):
            errors.append(f"{name} = {_shown(name, value)}: must be a table ([{name}])")
            value = {}
        tables[name] = value
    gateway, bridge = copy.deepcopy(tables["gateway"]), copy.deepcopy(tables["bridge"])
    if "gateway_id" in data:
        gateway_id = data["gateway_id"]
        if not isinstance(gateway_id, str) or not gateway_id:
            errors.append(f"gateway_id = {gateway_id!r}: must be a non-empty string (the gateway's id: topics, the "
                          "upstream client id)")
        for where, table, inner in (("gateway.broker", gateway, "broker"), ("bridge.bridge", bridge, "bridge")):
            section = table.setdefault(inner, {})
            if not isinstance(section, dict):
                continue  # the loaders name it
            if "gateway_id" in section and section["gateway_id"] != gateway_id:
                errors.append(f"{where}.gateway_id = {section['gateway_id']!r}: differs from gateway_id = "
                              f"{gateway_id!r}; give it once, at the top")
            section["gateway_id"] = gateway_id
    files = _parse_files(tables["files"], errors)
    keys = _parse_access(tables["access"], errors)
    return BoardSettings(gateway, bridge, files, keys), errors


def _parse_files(table: dict[str, Any], errors: list[str]) -> dict[str, str]:
    files: dict[str, str] = {}
    for name, text in table.items():
        if not FILE_NAME_RE.fullmatch(name):
            errors.append(f"files.{json.dumps(name)}: a file name must be {FILE_NAME_ALLOWED}")
        elif not isinstance(text, str) or not text.strip():
            errors.append(f"files.{name}: must be the file's text, a non-empty string (e.g. '''...''')")
        elif len(text.encode()) > MAX_FILE_BYTES:
            errors.append(f"files.{name}: {len(text.encode())} bytes; at most {MAX_FILE_BYTES} (1MB)")
        else:
            files[name] = text if text.endswith("\n") else text + "\n"
    return files


def _parse_access(table: dict[str, Any], errors: list[str]) -> tuple[str, ...]:
    for key in table:
        if key != "ssh_authorized_keys":
            errors.append(f"access.{key}: unknown key; allowed: ssh_authorized_keys")
    keys = table.get("ssh_authorized_keys", [])
    if not isinstance(keys, list):
        errors.append(f"access.ssh_authorized_keys = {keys!r}: must be an array of OpenSSH public key lines "
                      '(["ssh-ed25519 AAAA... op@laptop"])')
        return ()
    good: list[str] = []
    for i, line in enumerate(keys):
        why = ssh_public_key_error(line)
        if why:
            errors.append(f"access.ssh_authorized_keys[{i}] = {line!r}: {why}")
        else:
            good.append(line.strip())
    return tuple(good)


def ssh_public_key_error(line: Any) -> str | None:
    """Why ``line`` is not one OpenSSH public key line ``TYPE BASE64 [COMMENT]`` (no options), or ``None``.

    The base64 blob is decoded and must name the same key type, so a truncated or mangled paste is caught here
    rather than at the first login."""
    allowed = f"must be one line 'TYPE BASE64 [COMMENT]' as in a .pub file, TYPE one of {', '.join(SSH_KEY_TYPES)}"
    if not isinstance(line, str) or "\n" in line.strip() or "\r" in line:
        return allowed
    parts = line.split()
    if len(parts) < 2 or parts[0] not in SSH_KEY_TYPES:
        return allowed
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except binascii.Error:
        return f"the key (second field) is not valid base64; {allowed}"
    size = int.from_bytes(blob[:4], "big") if len(blob) >= 4 else -1
    if size < 0 or blob[4 : 4 + size] != parts[0].encode() or len(blob) < 4 + size + 16:
        return f"the key (second field) is not a {parts[0]} key (truncated or mangled?); {allowed}"
    return None


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged over ``base``: tables key by key, recursively; every other value of ``over`` (strings,
    numbers, arrays, arrays of tables) replaces ``base``'s. Neither argument is changed."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def plan(settings: BoardSettings, gateway_base: dict[str, Any], bridge_base: dict[str, Any] | None,
         files_dir: str) -> tuple[Plan, list[str]]:
    """The merged configurations and files one application installs, with ``{settings}/NAME`` in ``[gateway]``
    replaced by ``files_dir/NAME``, and the mistakes found doing so: a ``{settings}`` string that does not name a
    file of ``[files]`` (left as it is), or one in ``[bridge]`` (firmware-bridge cannot read the broker's files).
    """
    errors: list[str] = []
    gateway = _expand(settings.gateway, "gateway", settings.files, files_dir, errors)
    _refuse_placeholder(settings.bridge, "bridge", errors)
    bridge = None
    if bridge_base is not None or settings.bridge:
        bridge = merge(bridge_base or {}, settings.bridge)
    keys = "".join(f"{line}\n" for line in settings.ssh_authorized_keys) or None
    return Plan(merge(gateway_base, gateway), bridge, dict(settings.files), keys), errors


def _expand(value: Any, where: str, files: dict[str, str], files_dir: str, errors: list[str]) -> Any:
    if isinstance(value, dict):
        return {k: _expand(v, f"{where}.{k}", files, files_dir, errors) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, f"{where}[{i}]", files, files_dir, errors) for i, v in enumerate(value)]
    if not isinstance(value, str) or PLACEHOLDER not in value:
        return value
    name = value[len(PLACEHOLDER) + 1 :] if value.startswith(PLACEHOLDER + "/") else None
    if name not in files:
        given = ", ".join(files) or "none given"
        errors.append(f"{where} = {value!r}: must be \"{PLACEHOLDER}/NAME\" with NAME a file of [files] "
                      f"({given})")
        return value
    return f"{files_dir}/{name}"


def _refuse_placeholder(value: Any, where: str, errors: list[str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_placeholder(v, f"{where}.{k}", errors)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_placeholder(v, f"{where}[{i}]", errors)
    elif isinstance(value, str) and PLACEHOLDER in value:
        errors.append(f"{where} = {value!r}: {PLACEHOLDER} is for [gateway] only: the files of [files] are "
                      "readable by the broker's user, not by firmware-bridge")


def digest(*parts: Any) -> str:
    """SHA-256 of the parts as canonical JSON: equal settings over equal image configurations, equal digest."""
    text = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def settings_digest(settings: BoardSettings) -> str:
    """The digest of what a settings file says (not of its spelling or comments)."""
    return digest(settings.gateway, settings.bridge, settings.files, list(settings.ssh_authorized_keys))


def redact(line: str, secrets: list[str]) -> str:
    """``line`` with every secret (and its ``repr`` spelling, as error messages quote values) replaced by
    ``<secret>``; ``secrets`` longest first (:meth:`BoardSettings.secrets`)."""
    for secret in secrets:
        line = line.replace(repr(secret)[1:-1], SECRET_MARK).replace(secret, SECRET_MARK)
    return line


def _collect_secrets(value: Any, found: set[str], secret: bool = False) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _collect_secrets(v, found, bool(_SECRET_KEY.search(str(k))))
    elif isinstance(value, list):
        for v in value:
            _collect_secrets(v, found, secret)
    elif isinstance(value, str):
        if secret and value:
            found.add(value)
        elif "://" in value:
            try:
                password = urlsplit(value).password
            except ValueError:
                password = None
            if password:
                found.add(password)


def _shown(key: str, value: Any) -> str:
    return SECRET_MARK if key == "files" else repr(value)


# ------------------------------------------------------------------------------------------ TOML writer

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def dump_toml(data: dict[str, Any]) -> str:
    """``data`` (as :func:`tomllib.loads` returns it) as TOML text that reads back equal: the standard library
    reads TOML but does not write it.

    Raises:
        TypeError: a value TOML has no form for (None, bytes, ...).
    """
    lines: list[str] = []
    _dump_table(lines, [], data)
    return "\n".join(lines).lstrip("\n") + "\n"


def _dump_table(lines: list[str], path: list[str], table: dict[str, Any], header: str | None = None,
                always: bool = False) -> None:
    scalars = [(k, v) for k, v in table.items() if not isinstance(v, dict) and not _is_table_array(v)]
    # a table holding only tables needs no header of its own ([listeners] before [listeners.internal])
    if header is not None and (always or scalars or not table):
        lines.extend(("", header))
    lines.extend(f"{_toml_key(key)} = {_toml_value(value)}" for key, value in scalars)
    for key, value in table.items():
        sub = [*path, key]
        name = ".".join(map(_toml_key, sub))
        if isinstance(value, dict):
            _dump_table(lines, sub, value, f"[{name}]")
        elif _is_table_array(value):
            for item in value:
                _dump_table(lines, sub, item, f"[[{name}]]", always=True)


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    # JSON's escapes are TOML's, but TOML also forbids a raw DEL in a basic string
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007F")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, datetime.date | datetime.time):  # datetime is a date
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"{value!r}: TOML has no form for a {type(value).__name__}")
