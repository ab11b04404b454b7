"""firmware-bridge wire format (firmware-bridge/PROTOCOL.md): CRC, framing state machine, NMEA, fuzzing.

The decoders are sans-I/O, so these tests feed bytes directly; the same decoders run over real pseudo-terminals in
test_bridge_service.py.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

import pytest
from bridge_helpers import GARMIN_17N_LOG
from firmware_bridge.frames import (
    DEFAULT_MAX_LINE,
    Command,
    Fix,
    FrameDecoder,
    Ignored,
    NmeaDecoder,
    Reading,
    Rejected,
    Reply,
    crc16,
    encode_frame,
    nmea_checksum,
    reading_frame,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL_MD = ROOT / "firmware-bridge" / "PROTOCOL.md"

B01_FIRST = (
    b'{"dev":"buoy-b01","boot":3,"seq":0,"t":"2016-02-15T00:00:00Z",'
    b'"v":{"sea_surface_temperature":[4.929,"degC"]}}*0434\n'
)


def _crc16_bitwise(data: bytes) -> int:
    """The C routine of PROTOCOL.md, line for line."""
    crc = 0xFFFF
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc


def test_crc16_ccitt_false_check_value_29b1() -> None:
    """PROTOCOL.md: the CRC is CRC-16/CCITT-FALSE, whose catalogued check value over "123456789" is 0x29B1."""
    assert crc16(b"123456789") == 0x29B1
    assert _crc16_bitwise(b"123456789") == 0x29B1


@given(st.binary(max_size=600))
def test_crc16_library_matches_the_documented_c_routine(data: bytes) -> None:
    """PROTOCOL.md's C routine and the library (crcmod) compute the same CRC for any bytes."""
    assert crc16(data) == _crc16_bitwise(data)


def _protocol_examples() -> list[bytes]:
    lines = re.findall(r"^(\{.*\}\*[0-9A-F]{4})$", PROTOCOL_MD.read_text(), flags=re.MULTILINE)
    return [line.encode() + b"\n" for line in lines]


def test_protocol_md_examples_are_byte_exact() -> None:
    """PROTOCOL.md: every frame printed there decodes, CRC included (15 examples: 5 readings, 5 commands,
    5 replies), so the document cannot drift from the code."""
    examples = _protocol_examples()
    assert len(examples) == 15
    decoder = FrameDecoder()
    events = [e for line in examples for e in decoder.feed(line)]
    assert [type(e) for e in events].count(Reading) == 5
    assert [type(e) for e in events].count(Command) == 5
    assert [type(e) for e in events].count(Reply) == 5
    assert not [e for e in events if isinstance(e, Rejected)]
    assert events[0] == Reading(
        "buoy-b01", 3, 0, "2016-02-15T00:00:00.000Z", {"sea_surface_temperature": (4.929, "degC")}
    )
    mast = [e for e in events if isinstance(e, Reading) and e.device == "mast-2"]
    assert mast == [
        Reading(
            "mast-2",
            17,
            40213,
            None,
            {"air_temperature": (21.4, "degC"), "relative_humidity": (63, "%"), "battery_voltage": (3.91, "V")},
        ),
        Reading("mast-2", 17, 40214, "2024-05-01T12:00:00.000Z", {"air_temperature": (21.5, "degC")}),
    ]
    replies = [e for e in events if isinstance(e, Reply)]
    assert replies[0] == Reply("buoy-b01", 3, 7, True, {"pong": True}, None)
    assert replies[3] == Reply("buoy-b01", 3, 10, False, None, "unknown_command")


def test_encoder_produces_the_documented_bytes() -> None:
    """PROTOCOL.md: compact JSON, ``*``, 4 uppercase hex digits, ``\\n``; the first B01 example byte for byte."""
    assert (
        reading_frame("buoy-b01", 3, 0, {"sea_surface_temperature": (4.929, "degC")}, "2016-02-15T00:00:00Z")
        == B01_FIRST
    )


def test_byte_by_byte_feeding_and_crlf() -> None:
    """The framer keeps state across reads: a frame split into single bytes, or ending in CRLF, still decodes."""
    decoder = FrameDecoder()
    events = []
    for i in range(len(B01_FIRST)):
        events += decoder.feed(B01_FIRST[i : i + 1])
    events += decoder.feed(B01_FIRST[:-1] + b"\r\n")
    assert len(events) == 2 and events[0] == events[1] and isinstance(events[0], Reading)


def test_faults_are_rejected_by_reason_and_the_decoder_resynchronises() -> None:
    """PROTOCOL.md "What happens to bad input": garbage, bad CRC, over-long lines, bad JSON and bad fields are each
    counted under their reason and the next frame decodes."""
    good = B01_FIRST
    bad_crc = good[:-5] + b"0435\n"
    body = b'{"dev":"buoy-b01","boot":3,"seq":0}'
    no_v = body + b"*%04X\n" % crc16(body)
    not_json = b"{not json}*%04X\n" % crc16(b"{not json}")
    nan = b'{"dev":"x","boot":1,"seq":1,"v":{"a":[NaN,"u"]}}'
    nan_frame = nan + b"*%04X\n" % crc16(nan)
    stream = (
        b"\x00\xff\xfe\x81 noise\n"
        + good
        + bad_crc
        + b"{"
        + b"x" * 3000
        + b"}*0000\n"
        + good
        + no_v
        + not_json
        + nan_frame
        + b"\n\r\n   \n"
        + good
    )
    events = FrameDecoder().feed(stream)
    kinds = [e.reason if isinstance(e, Rejected) else type(e).__name__ for e in events]
    assert kinds == [
        "garbage",
        "Reading",
        "bad_crc",
        "too_long",
        "Reading",
        "bad_field",
        "bad_json",
        "bad_json",
        "Reading",
    ]


def test_max_line_is_512_bytes_a_513_byte_frame_is_too_long() -> None:
    """PROTOCOL.md: at most 512 bytes from "{" to the last CRC digit; one byte more is rejected as too_long."""

    def frame_of(length: int) -> bytes:
        base = {"dev": "buoy-b01", "boot": 1, "seq": 5, "v": {"x": [1, "u"]}, "pad": ""}
        pad = length - (len(encode_frame(base)) - 1)
        base["pad"] = "p" * pad
        frame = encode_frame(base)
        assert len(frame) - 1 == length
        return frame

    ok = FrameDecoder().feed(frame_of(DEFAULT_MAX_LINE))
    assert [type(e) for e in ok] == [Reading]
    too_long = FrameDecoder().feed(frame_of(DEFAULT_MAX_LINE + 1) + B01_FIRST)
    assert [e.reason if isinstance(e, Rejected) else "ok" for e in too_long] == ["too_long", "ok"]


def test_noise_before_a_frame_on_the_same_line_costs_only_the_noise() -> None:
    """A board powering up emits noise without a newline, then its first frame: the frame is found at the end of
    the line (noise counted as garbage), even when the noise alone is longer than max_line."""
    for noise in (b"\x00\x13\xfe{{*", b"\xaa" * 5000, b'{"dev":"x"' * 10):
        events = FrameDecoder().feed(noise + B01_FIRST)
        assert [type(e) for e in events] == [Rejected, Reading], noise
        assert events[0].reason == "garbage"


def test_bad_fields_are_named() -> None:
    """PROTOCOL.md field rules: device id pattern, integer boot/seq (not bool, not negative), snake_case quantity
    names, [number, unit] values, RFC 3339 UTC or Unix time."""
    cases = {
        '{"dev":"bad/id","boot":1,"seq":1,"v":{"a":[1,"u"]}}': "'dev'",
        '{"dev":"d","boot":true,"seq":1,"v":{"a":[1,"u"]}}': "'boot'",
        '{"dev":"d","boot":1,"seq":-1,"v":{"a":[1,"u"]}}': "'seq'",
        '{"dev":"d","boot":1,"seq":1,"v":{"Temp":[1,"u"]}}': "snake_case",
        '{"dev":"d","boot":1,"seq":1,"v":{"a":["1","u"]}}': "finite number",
        '{"dev":"d","boot":1,"seq":1,"v":{}}': "'v'",
        '{"dev":"d","boot":1,"seq":1,"t":"2016-02-15 00:00","v":{"a":[1,"u"]}}': "'t'",
        '{"dev":"d","boot":1,"seq":1,"t":"2016-13-15T00:00:00Z","v":{"a":[1,"u"]}}': "'t'",
    }
    for body, named in cases.items():
        raw = body.encode()
        events = FrameDecoder().feed(raw + b"*%04X\n" % crc16(raw))
        assert len(events) == 1 and isinstance(events[0], Rejected), body
        assert events[0].reason == "bad_field" and named in events[0].detail, (body, events[0].detail)


def test_nmea_garmin_17n_receiver_log() -> None:
    """NMEA 0183 from a real receiver (gpsd's garmin17n.log): checksums verified, GGA and RMC mapped to fix
    readings with the values gpsd decodes from the same log; the other 18 sentences ignored, none rejected."""
    events = NmeaDecoder().feed(GARMIN_17N_LOG.replace("\n", "\r\n").encode())
    fixes = [e for e in events if isinstance(e, Fix)]
    assert not [e for e in events if isinstance(e, Rejected)]
    assert len([e for e in events if isinstance(e, Ignored)]) == 18
    assert [(f.sentence, f.sensor_time) for f in fixes] == [
        ("RMC", "2005-03-16T09:38:02.000Z"),
        ("GGA", "2005-03-16T09:38:02.000Z"),
        ("RMC", "2005-03-16T09:38:03.000Z"),
        ("GGA", "2005-03-16T09:38:03.000Z"),
    ]
    assert fixes[0].values == {
        "latitude": (52.219065, "deg"),
        "longitude": (21.010851667, "deg"),
        "speed_over_ground": (0.0, "kn"),
        "course_over_ground": (226.0, "deg"),
    }
    assert fixes[1].values == {
        "latitude": (52.219065, "deg"),
        "longitude": (21.010851667, "deg"),
        "altitude": (137.2, "m"),
        "fix_quality": (2, "1"),
        "satellites": (10, "1"),
        "hdop": (0.9, "1"),
    }


def test_nmea_bad_checksum_missing_checksum_and_no_fix() -> None:
    """NMEA: a wrong or missing checksum is rejected (bad_checksum); RMC with status V publishes nothing; a GGA
    without a fix reports fix_quality 0 and no position."""
    good = "$GPGGA,093802,5213.1439,N,02100.6511,E,2,10,0.9,137.2,M,36.2,M,,*43"
    no_fix = "$GPGGA,,,,,,0,00,99.99,,,,,,*48"
    assert nmea_checksum(no_fix) == 0x48
    void_rmc = "$GPRMC,093802,V,,,,,,,160305,,,N*"
    void_rmc += f"{nmea_checksum(void_rmc):02X}"
    lines = [good[:-2] + "44", good[:-3], "$GPGGA,garbage*00", no_fix, void_rmc]
    events = NmeaDecoder().feed("\r\n".join(lines).encode() + b"\r\n")
    assert [(type(e).__name__, getattr(e, "reason", None)) for e in events] == [
        ("Rejected", "bad_checksum"),
        ("Rejected", "bad_checksum"),
        ("Rejected", "bad_checksum"),
        ("Fix", None),
        ("Ignored", None),
    ]
    assert events[3].values == {"fix_quality": (0, "1"), "satellites": (0, "1"), "hdop": (99.99, "1")}


# -- fuzzing -----------------------------------------------------------------------------------------------------

_names = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)
_numbers = st.one_of(st.integers(-(2**53) + 1, 2**53 - 1), st.floats(allow_nan=False, allow_infinity=False))
_readings = st.builds(
    Reading,
    device=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True),
    boot=st.integers(0, 2**32),
    seq=st.integers(0, 2**53 - 1),
    sensor_time=st.one_of(
        st.none(),
        st.datetimes(min_value=datetime(1970, 1, 2)).map(
            lambda d: d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond // 1000:03d}Z"
        ),
    ),
    values=st.dictionaries(
        _names, st.tuples(_numbers, st.text(max_size=8).filter(str.isprintable)), min_size=1, max_size=3
    ),
)


def _frame(r: Reading) -> bytes:
    return reading_frame(r.device, r.boot, r.seq, r.values, r.sensor_time)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.lists(st.integers(0, 2000), max_size=8))
def test_fuzz_random_bytes_never_raise(data: bytes, cuts: list[int]) -> None:
    """hypothesis: any bytes, cut into any reads, give only known events (no exception escapes), and the same
    events whatever the cuts (the state machine does not depend on read boundaries)."""
    for make in (FrameDecoder, NmeaDecoder):
        whole = make().feed(data + b"\n")
        decoder = make()
        pieces = []
        prev = 0
        for cut in sorted(c % (len(data) + 1) for c in cuts):
            pieces += decoder.feed(data[prev:cut])
            prev = cut
        pieces += decoder.feed(data[prev:] + b"\n")
        assert pieces == whole
        assert all(isinstance(e, Reading | Reply | Command | Fix | Ignored | Rejected) for e in whole)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.binary(max_size=700), _readings), min_size=1, max_size=6),
    st.binary(max_size=300),
    st.lists(st.integers(0, 10_000), max_size=10),
)
def test_fuzz_every_valid_frame_embedded_in_noise_is_found(
    pairs: list[tuple[bytes, Reading]], tail: bytes, cuts: list[int]
) -> None:
    """hypothesis: noise (any bytes, with or without newlines, longer than max_line or not) before each valid
    frame, the stream cut into arbitrary reads: every frame is decoded, in order, with its exact contents."""
    frames = [(noise, r, _frame(r)) for noise, r in pairs]
    frames = [(noise, r, f) for noise, r, f in frames if len(f) - 1 <= DEFAULT_MAX_LINE]
    stream = b"".join(noise + f for noise, _, f in frames) + tail
    decoder = FrameDecoder()
    events = []
    prev = 0
    for cut in sorted(c % (len(stream) + 1) for c in cuts):
        events += decoder.feed(stream[prev:cut])
        prev = cut
    events += decoder.feed(stream[prev:])
    found = [e for e in events if isinstance(e, Reading)]
    assert found == [r for _, r, _ in frames]


@pytest.mark.parametrize("reason_input", [b"\xff" * 10, b"*ABCD", b"{}*ABCD", b"{\xff}*" + b"%04X" % crc16(b"{\xff}")])
def test_short_inputs_are_rejected_not_raised(reason_input: bytes) -> None:
    """Degenerate lines (binary, a bare trailer, an empty object with a wrong CRC, invalid UTF-8 under a valid CRC)
    are each one Rejected event."""
    events = FrameDecoder().feed(reason_input + b"\n")
    assert len(events) == 1 and isinstance(events[0], Rejected)
