"""The serial wire format (PROTOCOL.md), sans-I/O: bytes in, events out.

Two decoders share one line framer:

* :class:`FrameDecoder` for ``line-json`` ports: one JSON object per line followed by ``*`` and the
  CRC-16/CCITT-FALSE of the bytes before ``*`` in 4 hex digits, then ``\\n``.
* :class:`NmeaDecoder` for ``nmea`` ports: NMEA 0183 sentences (checksums verified, parsed with pynmea2);
  GGA and RMC become position/fix readings.

Nothing here reads a clock, a file or a socket. ``feed(data)`` never raises on any input: whatever cannot be
decoded comes back as a :class:`Rejected` event naming the reason, and the framer resynchronises at the next
newline. A line longer than ``max_line`` is rejected as ``too_long`` unless a complete, valid frame sits at its
end (a board that powers up emitting noise without a newline, then its first frame, loses nothing).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time
from typing import Any

import crcmod.predefined
import pynmea2

# CRC-16/CCITT-FALSE: poly 0x1021, init 0xFFFF, no reflection, no final XOR; check("123456789") = 0x29B1.
crc16 = crcmod.predefined.mkPredefinedCrcFun("crc-ccitt-false")

DEFAULT_MAX_LINE = 512  # bytes of one line-json frame, trailer included, "\n" (and an optional "\r") excluded
NMEA_MAX_LINE = 128  # NMEA 0183 allows 82 characters; receivers with long proprietary sentences need a bit more
MAX_CANDIDATES = 64  # "{" positions tried per line when noise precedes a frame on the same line

DEVICE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
QUANTITY_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
COMMAND_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_TRAILER_RE = re.compile(rb"\*([0-9A-Fa-f]{4})$")
_TIME_RE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?Z$")
MAX_INT = 2**53 - 1  # the largest integer every JSON consumer reads exactly
MAX_VALUES = 32
MAX_UNIT_LEN = 16

# Rejection reasons (the bridge counts them by these names).
TOO_LONG = "too_long"
GARBAGE = "garbage"
BAD_CRC = "bad_crc"
BAD_JSON = "bad_json"
BAD_FIELD = "bad_field"
BAD_CHECKSUM = "bad_checksum"
BAD_SENTENCE = "bad_sentence"
REASONS = (TOO_LONG, GARBAGE, BAD_CRC, BAD_JSON, BAD_FIELD, BAD_CHECKSUM, BAD_SENTENCE)


@dataclass(frozen=True, slots=True)
class Reading:
    """One measurement frame from a board.

    Attributes:
        device: the board's device id.
        boot: its boot counter; seq: the frame's sequence number within that boot.
        sensor_time: the board's timestamp normalised to RFC 3339 UTC with milliseconds, or None.
        values: quantity -> (value, unit), in the frame's order.
    """

    device: str
    boot: int
    seq: int
    sensor_time: str | None
    values: dict[str, tuple[float | int, str]]


@dataclass(frozen=True, slots=True)
class Reply:
    """A board's answer to command ``id``."""

    device: str
    boot: int | None
    id: int
    ok: bool
    data: dict[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Command:
    """A command line as the bridge writes it to a board (the simulator decodes these)."""

    device: str
    cmd: str
    id: int
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Fix:
    """A position/fix reading mapped from one NMEA sentence (GGA or RMC)."""

    sentence: str
    sensor_time: str | None
    values: dict[str, tuple[float | int, str]]


@dataclass(frozen=True, slots=True)
class Ignored:
    """A valid NMEA sentence that carries no reading (GSA, GSV, VTG, proprietary, RMC without a fix...)."""

    sentence: str


@dataclass(frozen=True, slots=True)
class Rejected:
    """Input that was not a valid frame. ``sample`` holds at most 48 bytes of it, for the log."""

    reason: str
    detail: str
    sample: bytes = b""


Event = Reading | Reply | Command | Fix | Ignored | Rejected


def format_time(dt: datetime) -> str:
    """RFC 3339 UTC with millisecond precision and ``Z``: ``2016-02-15T00:30:00.000Z``."""
    dt = dt.astimezone(UTC) if dt.tzinfo else dt.replace(tzinfo=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def encode_frame(obj: dict[str, Any]) -> bytes:
    """One line-json frame: compact JSON (key order kept), ``*``, CRC in 4 uppercase hex digits, ``\\n``."""
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    return body + b"*%04X\n" % crc16(body)


def reading_frame(
    device: str, boot: int, seq: int, values: dict[str, tuple[float | int, str]], sensor_time: str | None = None
) -> bytes:
    """The frame a board sends for one reading (``t`` is left out when ``sensor_time`` is None)."""
    obj: dict[str, Any] = {"dev": device, "boot": boot, "seq": seq}
    if sensor_time is not None:
        obj["t"] = sensor_time
    obj["v"] = {name: [value, unit] for name, (value, unit) in values.items()}
    return encode_frame(obj)


def command_frame(device: str, cmd: str, cmd_id: int, args: dict[str, Any] | None = None) -> bytes:
    """The command line the bridge writes to a board."""
    return encode_frame({"dev": device, "cmd": cmd, "id": cmd_id, "args": args or {}})


def reply_frame(
    device: str, boot: int, cmd_id: int, ok: bool, data: dict[str, Any] | None = None, error: str | None = None
) -> bytes:
    """The reply line a board sends back for command ``cmd_id``."""
    obj: dict[str, Any] = {"dev": device, "boot": boot, "re": cmd_id, "ok": ok}
    if data is not None:
        obj["data"] = data
    if error is not None:
        obj["error"] = error
    return encode_frame(obj)


class LineFramer:
    """Splits a byte stream at ``\\n``. Holds at most ``max_line + 1`` bytes of the current line (the tail);
    a longer line comes out with ``overflowed=True``."""

    def __init__(self, max_line: int) -> None:
        self.max_line = max_line
        self._buf = bytearray()
        self._overflowed = False

    def feed(self, data: bytes) -> list[tuple[bytes, bool]]:
        """Complete lines (without ``\\n``) and whether each exceeded the window."""
        lines: list[tuple[bytes, bool]] = []
        keep = self.max_line + 1  # room for one trailing "\r"
        start = 0
        while True:
            nl = data.find(b"\n", start)
            chunk = data[start:] if nl < 0 else data[start:nl]
            self._buf += chunk
            if len(self._buf) > keep:
                del self._buf[: len(self._buf) - keep]
                self._overflowed = True
            if nl < 0:
                return lines
            lines.append((bytes(self._buf), self._overflowed))
            self._buf.clear()
            self._overflowed = False
            start = nl + 1

    def reset(self) -> None:
        """Forget a partial line (the port was closed)."""
        self._buf.clear()
        self._overflowed = False


def _sample(line: bytes) -> bytes:
    return line[:48]


def _check_int(obj: dict[str, Any], key: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT:
        raise ValueError(f"{key!r} must be an integer 0..2^53-1, got {value!r}")
    return value


def _check_device(obj: dict[str, Any]) -> str:
    dev = obj.get("dev")
    if not isinstance(dev, str) or not DEVICE_RE.match(dev):
        raise ValueError(f"'dev' must match {DEVICE_RE.pattern}, got {dev!r}")
    return dev


def parse_time(value: Any) -> str | None:
    """A board timestamp (RFC 3339 UTC string with ``Z``, Unix seconds, or null) in the envelope's form."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("'t' must be an RFC 3339 UTC string, Unix seconds or null")
    if isinstance(value, int | float):
        if not math.isfinite(value) or not 0 <= value < 253402300800:  # before year 10000
            raise ValueError(f"'t' out of range: {value!r}")
        return format_time(datetime.fromtimestamp(value, UTC))
    if isinstance(value, str):
        m = _TIME_RE.match(value)
        if m:
            frac = (m.group(7) or "0")[:6].ljust(6, "0")
            try:
                year, month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 7))
                dt = datetime(year, month, day, hour, minute, second, int(frac), tzinfo=UTC)
            except ValueError as exc:
                raise ValueError(f"'t' is not a valid time: {value!r}") from exc
            return format_time(dt)
    raise ValueError(f"'t' must be an RFC 3339 UTC string ending in Z, Unix seconds or null, got {value!r}")


def _check_values(raw: Any) -> dict[str, tuple[float | int, str]]:
    if not isinstance(raw, dict) or not raw or len(raw) > MAX_VALUES:
        raise ValueError(f"'v' must be an object of 1..{MAX_VALUES} quantities")
    values: dict[str, tuple[float | int, str]] = {}
    for name, pair in raw.items():
        if not QUANTITY_RE.match(name):
            raise ValueError(f"quantity name {name!r} must be snake_case ({QUANTITY_RE.pattern})")
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"'v.{name}' must be [value, unit]")
        value, unit = pair
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"'v.{name}' value must be a finite number, got {value!r}")
        if isinstance(value, int) and abs(value) > MAX_INT:
            raise ValueError(f"'v.{name}' value out of range")
        if not isinstance(unit, str) or len(unit) > MAX_UNIT_LEN or not unit.isprintable():
            raise ValueError(f"'v.{name}' unit must be a printable string of at most {MAX_UNIT_LEN} characters")
        values[name] = (value, unit)
    return values


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_object(obj: Any) -> Reading | Reply | Command:
    """Classify and validate a frame's JSON object (raises ValueError naming the bad field)."""
    if not isinstance(obj, dict):
        raise ValueError("a frame must be a JSON object")
    dev = _check_device(obj)
    if "re" in obj:
        cmd_id = _check_int(obj, "re")
        ok = obj.get("ok")
        if not isinstance(ok, bool):
            raise ValueError("'ok' must be true or false")
        data = obj.get("data")
        if data is not None and not isinstance(data, dict):
            raise ValueError("'data' must be an object")
        error = obj.get("error")
        if error is not None and not isinstance(error, str):
            raise ValueError("'error' must be a string")
        boot = _check_int(obj, "boot") if "boot" in obj else None
        return Reply(dev, boot, cmd_id, ok, data, error)
    if "cmd" in obj:
        cmd = obj.get("cmd")
        if not isinstance(cmd, str) or not COMMAND_RE.match(cmd):
            raise ValueError(f"'cmd' must match {COMMAND_RE.pattern}")
        args = obj.get("args", {})
        if not isinstance(args, dict):
            raise ValueError("'args' must be an object")
        return Command(dev, cmd, _check_int(obj, "id"), args)
    boot = _check_int(obj, "boot")
    seq = _check_int(obj, "seq")
    return Reading(dev, boot, seq, parse_time(obj.get("t")), _check_values(obj.get("v")))


def _decode_candidate(body: bytes) -> Reading | Reply | Command | Rejected:
    try:
        text = body.decode("utf-8")
        obj = json.loads(text, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return Rejected(BAD_JSON, str(exc)[:120], _sample(body))
    try:
        return decode_object(obj)
    except (ValueError, TypeError, OverflowError) as exc:
        return Rejected(BAD_FIELD, str(exc)[:120], _sample(body))


class FrameDecoder:
    """Sans-I/O decoder for a ``line-json`` port: ``feed(bytes) -> [Reading | Reply | Command | Rejected]``."""

    def __init__(self, max_line: int = DEFAULT_MAX_LINE) -> None:
        self.framer = LineFramer(max_line)

    def reset(self) -> None:
        self.framer.reset()

    def feed(self, data: bytes) -> list[Event]:
        events: list[Event] = []
        for line, overflowed in self.framer.feed(data):
            events.extend(self.decode_line(line, overflowed))
        return events

    def decode_line(self, line: bytes, overflowed: bool = False) -> list[Event]:
        """The events of one line (without its ``\\n``)."""
        if line.endswith(b"\r"):
            line = line[:-1]
        if not overflowed and not line.strip(b" \t"):
            return []  # blank lines are allowed between frames
        if not overflowed and len(line) > self.framer.max_line:
            overflowed = True
        m = _TRAILER_RE.search(line)
        if m is None:
            if overflowed:
                return [Rejected(TOO_LONG, f"line longer than {self.framer.max_line} bytes", _sample(line))]
            return [Rejected(GARBAGE, "no *CRC trailer", _sample(line))]
        expected = int(m.group(1), 16)
        body = line[: m.start()]
        # The frame starts at one of the "{" of the line; try them from the right (the frame's own inner braces
        # come first, noise before the frame last), and take the first whose CRC matches and that decodes.
        first_failure: Rejected | None = None
        pos = len(body)
        for _ in range(MAX_CANDIDATES):
            pos = body.rfind(b"{", 0, pos)
            if pos < 0:
                break
            candidate = body[pos:]
            if len(candidate) + 5 > self.framer.max_line or crc16(candidate) != expected:
                continue
            event = _decode_candidate(candidate)
            if isinstance(event, Rejected):
                first_failure = first_failure or event
                continue
            prefix = body[:pos]
            if prefix.strip(b" \t\r"):
                return [Rejected(GARBAGE, f"{len(prefix)} bytes of noise before a frame", _sample(prefix)), event]
            return [event]
        if first_failure is not None:
            return [first_failure]
        if overflowed:
            return [Rejected(TOO_LONG, f"line longer than {self.framer.max_line} bytes", _sample(line))]
        if b"{" in body:
            return [
                Rejected(BAD_CRC, f"CRC mismatch (trailer {expected:04X}, computed {crc16(body):04X})", _sample(line))
            ]
        return [Rejected(GARBAGE, "no frame before the *CRC trailer", _sample(line))]


def nmea_checksum(sentence: str) -> int:
    """XOR of the characters between ``$`` (or ``!``) and ``*``."""
    value = 0
    for ch in sentence.lstrip("$!").split("*", 1)[0]:
        value ^= ord(ch)
    return value


def _num(text: str, kind: type = float) -> float | int | None:
    text = text.strip()
    if not text:
        return None
    value = kind(text)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("not finite")
    return value


class NmeaDecoder:
    """Sans-I/O decoder for an ``nmea`` port: ``feed(bytes) -> [Fix | Ignored | Rejected]``.

    GGA: ``latitude``, ``longitude`` (deg), ``altitude`` (m), ``fix_quality``, ``satellites``, ``hdop``.
    RMC with status A: ``latitude``, ``longitude``, ``speed_over_ground`` (kn), ``course_over_ground`` (deg).
    The date for GGA's time of day comes from the last RMC or ZDA on the same port.
    """

    def __init__(self, max_line: int = NMEA_MAX_LINE) -> None:
        self.framer = LineFramer(max_line)
        self.date: date | None = None

    def reset(self) -> None:
        self.framer.reset()

    def feed(self, data: bytes) -> list[Event]:
        events: list[Event] = []
        for line, overflowed in self.framer.feed(data):
            event = self.decode_line(line, overflowed)
            if event is not None:
                events.append(event)
        return events

    def decode_line(self, line: bytes, overflowed: bool = False) -> Event | None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not overflowed and not line.strip(b" \t"):
            return None
        start = max(line.rfind(b"$"), line.rfind(b"!"))
        if start < 0:
            if overflowed:
                return Rejected(TOO_LONG, f"line longer than {self.framer.max_line} bytes", _sample(line))
            return Rejected(GARBAGE, "no NMEA sentence", _sample(line))
        raw = line[start:]
        if len(raw) > self.framer.max_line:
            return Rejected(TOO_LONG, f"sentence longer than {self.framer.max_line} bytes", _sample(line))
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            return Rejected(GARBAGE, "non-ASCII bytes in a sentence", _sample(line))
        if not text.isprintable():
            return Rejected(GARBAGE, "control bytes in a sentence", _sample(line))
        if not re.search(r"\*[0-9A-Fa-f]{2}$", text):
            return Rejected(BAD_CHECKSUM, "no *hh checksum", _sample(raw))
        try:
            msg = pynmea2.parse(text, check=True)
        except pynmea2.ChecksumError as exc:
            return Rejected(BAD_CHECKSUM, str(exc.args[0]) if exc.args else "checksum", _sample(raw))
        except pynmea2.SentenceTypeError:
            return Ignored(text[1:].split(",", 1)[0][:10])
        except Exception as exc:  # pynmea2 raises assorted errors on malformed fields
            return Rejected(BAD_SENTENCE, f"{type(exc).__name__}: {exc}"[:120], _sample(raw))
        address = text[1:].split(",", 1)[0].split("*", 1)[0][:10]
        kind = msg.sentence_type if isinstance(msg, pynmea2.TalkerSentence) else address  # proprietary: PGRME
        try:
            return self._map(kind, msg)
        except Exception as exc:  # a field pynmea2 accepted but that is not a number
            return Rejected(BAD_SENTENCE, f"{kind}: {type(exc).__name__}: {exc}"[:120], _sample(raw))

    def _map(self, kind: str, msg: Any) -> Event:
        if kind == "RMC":
            if msg.datestamp is not None:
                self.date = msg.datestamp
            if msg.status != "A" or not msg.lat or not msg.lon:
                return Ignored("RMC")
            values: dict[str, tuple[float | int, str]] = {
                "latitude": (round(msg.latitude, 9), "deg"),
                "longitude": (round(msg.longitude, 9), "deg"),
            }
            speed = _num(msg.data[6])
            if speed is not None:
                values["speed_over_ground"] = (speed, "kn")
            course = _num(msg.data[7])
            if course is not None:
                values["course_over_ground"] = (course, "deg")
            return Fix("RMC", self._time(msg.timestamp, msg.datestamp), values)
        if kind == "GGA":
            values = {}
            if msg.lat and msg.lon:
                values["latitude"] = (round(msg.latitude, 9), "deg")
                values["longitude"] = (round(msg.longitude, 9), "deg")
                altitude = _num(msg.data[8])
                if altitude is not None:
                    values["altitude"] = (altitude, "m")
            quality = _num(msg.data[5], int)
            values["fix_quality"] = (quality if quality is not None else 0, "1")
            sats = _num(msg.data[6], int)
            if sats is not None:
                values["satellites"] = (sats, "1")
            hdop = _num(msg.data[7])
            if hdop is not None:
                values["hdop"] = (hdop, "1")
            return Fix("GGA", self._time(msg.timestamp, self.date), values)
        if kind == "ZDA" and msg.year and msg.month and msg.day:
            self.date = date(int(msg.year), int(msg.month), int(msg.day))
        return Ignored(kind)

    @staticmethod
    def _time(tod: time | None, day: date | None) -> str | None:
        if tod is None or day is None:
            return None
        return format_time(datetime.combine(day, tod.replace(tzinfo=None), UTC))
