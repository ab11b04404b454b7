"""What ``edge-gateway update pull`` decides, without I/O: the pull's layer (:mod:`gateway.update.pull`) reads the
files and the clock and hands their contents here, so every rule is tested in process with the time passed in.

Inputs and outputs:

- :func:`parse_manifest`: the manifest's bytes and URL -> :class:`Manifest`, or :class:`ManifestError` naming the
  field, the value and what is allowed.
- :func:`decide`: a manifest, this gateway's ``compatible``, the installed version and the versions rejected here
  -> :class:`Decision` (install, or why not).
- :func:`rolled_back_version`, :func:`pending_outcome`: the health check's ``last`` record and the pull's own
  ``pending`` record -> a version to reject from now on.
- :class:`Window`: the maintenance window, ``contains(now)`` and ``next_opening(now)`` on local wall-clock times.
- :func:`space_needed`: the free-space rule, in bytes.
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass
from enum import Enum
from urllib.parse import urljoin, urlsplit

__all__ = [
    "Action",
    "Decision",
    "Manifest",
    "ManifestError",
    "Pending",
    "Window",
    "compare_versions",
    "decide",
    "parse_key_values",
    "parse_manifest",
    "pending_outcome",
    "rolled_back_version",
    "space_needed",
]

# A version names files (``rejected-<version>``) and goes into log lines and shell-less argv: letters, digits and
# ``. _ + ~ -`` only, as Debian and PEP 440 versions are spelled, so no version can make a path or a log line lie.
VERSION_ALLOWED = "1 to 64 letters, digits and . _ + ~ - (such as \"1.4.2\")"
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+~-]{0,63}$")
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
_WINDOW = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")
WINDOW_ALLOWED = 'two local times "HH:MM-HH:MM" such as "02:00-04:00" (it may cross midnight: "23:00-01:00")'


class ManifestError(ValueError):
    """The manifest cannot be used; the message names the field, the value and what is allowed."""


@dataclass(frozen=True, slots=True)
class Manifest:
    """One release for one ``compatible``: the bundle at ``url`` (absolute https) has ``size`` bytes and SHA-256
    ``sha256`` (lower-case hex)."""

    version: str
    compatible: str
    url: str
    sha256: str
    size: int

    @property
    def bundle_name(self) -> str:
        """The verified bundle's file name in the download directory (content-addressed, so a new manifest for
        the same bytes reuses a download and a changed bundle never reuses a stale one)."""
        return f"{self.sha256}.raucb"


def parse_manifest(data: bytes, manifest_url: str, max_bundle_size: int) -> Manifest:
    """The manifest: a JSON object ``{"version", "compatible", "url", "sha256", "size"}``; other keys are ignored
    so a server can add fields for newer gateways. ``url`` may be relative to ``manifest_url``; it must resolve to
    an https:// URL (the bundle is not fetched over plain HTTP, even though its hash is checked).

    Raises:
        ManifestError: not JSON, not an object, or a field missing or invalid (``size`` above
            ``max_bundle_size`` included).
    """
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"must be a JSON object, not {type(doc).__name__}")
    missing = [key for key in ("version", "compatible", "url", "sha256", "size") if key not in doc]
    if missing:
        raise ManifestError(f"missing {', '.join(missing)}; a manifest has version, compatible, url, sha256, size")
    version, compatible, url, sha256, size = (doc[k] for k in ("version", "compatible", "url", "sha256", "size"))
    if not isinstance(version, str) or not _VERSION.match(version):
        raise ManifestError(f"version = {version!r}: must be {VERSION_ALLOWED}")
    if not isinstance(compatible, str) or not compatible or not compatible.isprintable():
        raise ManifestError(f"compatible = {compatible!r}: must be a RAUC compatible string such as "
                            '"edge-gateway-arm64"')
    if not isinstance(url, str) or not url or not url.isprintable() or " " in url:
        raise ManifestError(f"url = {url!r}: must be the bundle's URL (absolute, or relative to the manifest)")
    absolute = urljoin(manifest_url, url)
    parts = urlsplit(absolute)
    if parts.scheme != "https" or not parts.hostname:
        raise ManifestError(f"url = {url!r}: must resolve to an https:// URL (it resolves to {absolute!r})")
    if not isinstance(sha256, str) or not _SHA256.match(sha256):
        raise ManifestError(f"sha256 = {sha256!r}: must be the bundle's SHA-256 as 64 hex digits")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ManifestError(f"size = {size!r}: must be the bundle's size in bytes, an integer > 0")
    if size > max_bundle_size:
        raise ManifestError(f"size = {size}: more than [update] max_bundle_size ({max_bundle_size} bytes)")
    return Manifest(version, compatible, absolute, sha256.lower(), size)


def _version_key(version: str) -> list[tuple[int, int | str]]:
    # Runs of digits compare as numbers (1.10 > 1.9), runs of letters as text; a number sorts after a word in the
    # same place, and a longer version after its own prefix (1.2 < 1.2.1).
    return [(1, int(part)) if part.isdigit() else (0, part) for part in re.findall(r"\d+|[A-Za-z]+", version)]


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as ``a`` is older than, the same as or newer than ``b``: dot- or dash-separated numbers and
    words, numbers numerically (``1.10`` > ``1.9``), a longer version after its prefix (``1.2.1`` > ``1.2``).
    Equal strings are the same version; ``1.2`` and ``1.02`` compare equal but are different versions (0 only
    when the strings are equal, else the string order decides, so the answer is never ambiguous)."""
    if a == b:
        return 0
    ka, kb = _version_key(a), _version_key(b)
    if ka != kb:
        return -1 if ka < kb else 1
    return -1 if a < b else 1


class Action(Enum):
    """What to do with a manifest."""

    INSTALL = "install"
    OTHER_COMPATIBLE = "other_compatible"  # for another kind of gateway: ignored
    UP_TO_DATE = "up_to_date"  # the installed version
    OLDER = "older"  # older than the installed one: not a downgrade path (rauc install by hand does that)
    REJECTED = "rejected"  # rolled back on this gateway before


@dataclass(frozen=True, slots=True)
class Decision:
    """An :class:`Action` and the log line that explains it."""

    action: Action
    reason: str


def decide(manifest: Manifest, compatible: str, installed: str | None, rejected: frozenset[str]) -> Decision:
    """Whether to download and install ``manifest`` on a gateway whose RAUC ``compatible`` and installed
    version (``None``: unknown, e.g. no release file) are given, and which rolled back ``rejected`` before."""
    if manifest.compatible != compatible:
        return Decision(Action.OTHER_COMPATIBLE, f"the manifest is for compatible {manifest.compatible!r}, this "
                                                 f"gateway is {compatible!r}: ignored")
    if installed is not None and manifest.version == installed:
        return Decision(Action.UP_TO_DATE, f"version {installed} is installed: nothing to do")
    if manifest.version in rejected:
        return Decision(Action.REJECTED, f"version {manifest.version} rolled back on this gateway before: not "
                                         "installed again (publish a newer version)")
    if installed is not None and compare_versions(manifest.version, installed) < 0:
        return Decision(Action.OLDER, f"version {manifest.version} is older than the installed {installed}: not "
                                      "installed (a downgrade is `rauc install FILE` by hand)")
    return Decision(Action.INSTALL, f"version {manifest.version} is available (installed: {installed or 'unknown'})")


def parse_key_values(text: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (os-release style: ``#`` comments, optional single or double quotes around the value),
    as the release file and the health check's ``last`` record are written."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def rolled_back_version(last: str) -> str | None:
    """The version the health check rolled back from, from its ``last`` record (``OUTCOME=rolled_back`` and
    ``PREVIOUS=<the failed version>``), or ``None``."""
    record = parse_key_values(last)
    version = record.get("PREVIOUS", "")
    if record.get("OUTCOME") == "rolled_back" and _VERSION.match(version):
        return version
    return None


@dataclass(frozen=True, slots=True)
class Pending:
    """The pull's own record of an install it made: the version and the boot it was made in."""

    version: str
    boot_id: str

    def dump(self) -> str:
        return f"VERSION={self.version}\nBOOT_ID={self.boot_id}\n"

    @classmethod
    def load(cls, text: str) -> Pending | None:
        record = parse_key_values(text)
        version, boot_id = record.get("VERSION", ""), record.get("BOOT_ID", "")
        return cls(version, boot_id) if _VERSION.match(version) and boot_id else None


def pending_outcome(pending: Pending, installed: str | None, boot_id: str) -> str:
    """What became of an install the pull made: ``"booted"`` (the gateway runs it now), ``"rolled_back"`` (a
    later boot still runs another version: the new slot did not stay, whatever the health check wrote) or
    ``"awaiting_reboot"`` (still the boot it was installed in)."""
    if installed == pending.version:
        return "booted"
    if boot_id != pending.boot_id:
        return "rolled_back"
    return "awaiting_reboot"


@dataclass(frozen=True, slots=True)
class Window:
    """A daily maintenance window on local wall-clock time, ``start`` inclusive, ``end`` exclusive, in minutes
    after midnight; it crosses midnight when ``end < start``."""

    start: int
    end: int

    @classmethod
    def parse(cls, value: object) -> Window:
        """From ``"HH:MM-HH:MM"``.

        Raises:
            ValueError: anything else, or the same start and end; the message says what is allowed.
        """
        m = _WINDOW.match(value) if isinstance(value, str) else None
        if m:
            h1, m1, h2, m2 = (int(g) for g in m.groups())
            if h1 < 24 and h2 < 24 and m1 < 60 and m2 < 60 and (h1, m1) != (h2, m2):
                return cls(h1 * 60 + m1, h2 * 60 + m2)
        raise ValueError(f"must be {WINDOW_ALLOWED}, start and end different")

    @property
    def minutes(self) -> int:
        """How long it is open."""
        return (self.end - self.start) % (24 * 60)

    def __str__(self) -> str:
        return f"{self.start // 60:02d}:{self.start % 60:02d}-{self.end // 60:02d}:{self.end % 60:02d}"

    def contains(self, now: datetime.datetime) -> bool:
        """True when the local time ``now`` is inside the window."""
        minute = now.hour * 60 + now.minute
        return (minute - self.start) % (24 * 60) < self.minutes

    def next_opening(self, now: datetime.datetime) -> datetime.datetime:
        """The next time the window opens after ``now`` (today or tomorrow), on the same clock as ``now``."""
        opening = now.replace(hour=self.start // 60, minute=self.start % 60, second=0, microsecond=0)
        if opening <= now:
            opening += datetime.timedelta(days=1)
        return opening


def space_needed(remaining_download: int, store_max_size: int, store_allocated: int, reserve: int,
                 shares_store_fs: bool) -> int:
    """Free bytes the download directory's file system must have before a download starts: what is left to
    download, plus the room the store may still grow into on the same file system (``store.max_size`` less
    what its ``data.mdb`` already occupies; nothing when the store lives elsewhere), plus ``reserve``. A bundle
    may therefore never take the space the broker was promised, and the store never refuses a QoS 1/2 message
    because an update filled its disk."""
    store_room = max(0, store_max_size - store_allocated) if shares_store_fs else 0
    return max(0, remaining_download) + store_room + reserve
