"""MQTT data representations (MQTT 5.0 §1.5, MQTT 3.1.1 §1.5): integers, strings, binary data, VBIs.

Decoders take ``(buf, pos)`` and return ``(value, new_pos)``; they raise :class:`MalformedPacket` when the
bytes run out or break a rule. Encoders return ``bytes``.
"""

from __future__ import annotations

import struct
from typing import Final

from gateway.mqtt.errors import MalformedPacket

_U16: Final = struct.Struct("!H")
_U32: Final = struct.Struct("!I")

#: Largest value a Variable Byte Integer can hold (MQTT 5.0 §1.5.5): 268,435,455.
VBI_MAX: Final = 268_435_455


def encode_vbi(value: int) -> bytes:
    """Encode a Variable Byte Integer (1-4 bytes, MQTT 5.0 §1.5.5, MQTT 3.1.1 §2.2.3).

    Raises:
        ValueError: ``value`` is negative or above :data:`VBI_MAX`.
    """
    if value < 128:
        if value < 0:
            raise ValueError(f"Variable Byte Integer must be >= 0, got {value}")
        return bytes((value,))
    if value > VBI_MAX:
        raise ValueError(f"Variable Byte Integer must be <= {VBI_MAX}, got {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def vbi_size(value: int) -> int:
    """Bytes :func:`encode_vbi` takes for ``value`` (1-4; MQTT 5.0 §1.5.5), without encoding it."""
    if value < 128:
        return 1
    if value < 16_384:
        return 2
    return 3 if value < 2_097_152 else 4


def decode_vbi(buf: bytes, pos: int) -> tuple[int, int]:
    """Decode a Variable Byte Integer at ``pos``.

    Raises:
        MalformedPacket: more than 4 bytes [MQTT-1.5.5-1], or the buffer ends inside it.
    """
    value = 0
    shift = 0
    end = len(buf)
    for _ in range(4):
        if pos >= end:
            raise MalformedPacket("Variable Byte Integer runs past the end of the packet")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise MalformedPacket("Variable Byte Integer longer than 4 bytes [MQTT-1.5.5-1]")


def encode_u16(value: int) -> bytes:
    """Encode a Two Byte Integer (big-endian, MQTT 5.0 §1.5.2)."""
    return _U16.pack(value)


def decode_u16(buf: bytes, pos: int) -> tuple[int, int]:
    """Decode a Two Byte Integer. Raises :class:`MalformedPacket` when fewer than 2 bytes remain."""
    if pos + 2 > len(buf):
        raise MalformedPacket("Two Byte Integer runs past the end of the packet")
    return (buf[pos] << 8) | buf[pos + 1], pos + 2


def encode_u32(value: int) -> bytes:
    """Encode a Four Byte Integer (big-endian, MQTT 5.0 §1.5.3)."""
    return _U32.pack(value)


def decode_u32(buf: bytes, pos: int) -> tuple[int, int]:
    """Decode a Four Byte Integer. Raises :class:`MalformedPacket` when fewer than 4 bytes remain."""
    if pos + 4 > len(buf):
        raise MalformedPacket("Four Byte Integer runs past the end of the packet")
    return _U32.unpack_from(buf, pos)[0], pos + 4


def encode_binary(value: bytes) -> bytes:
    """Encode Binary Data: a 2-byte length then the bytes (MQTT 5.0 §1.5.6), at most 65,535 bytes.

    Raises:
        ValueError: longer than 65,535 bytes.
    """
    return _encode_prefixed(value, "Binary Data")


def _encode_prefixed(data: bytes, name: str) -> bytes:
    """``data`` after its 2-byte length, the wire form of Binary Data and UTF-8 Encoded Strings (``name``).

    Raises:
        ValueError: longer than 65,535 bytes.
    """
    if len(data) > 0xFFFF:
        raise ValueError(f"{name} is limited to 65535 bytes, got {len(data)}")
    return _U16.pack(len(data)) + data


def _decode_prefixed(buf: bytes, pos: int, name: str) -> tuple[bytes, int]:
    """The bytes after a 2-byte length at ``pos`` and the position after them (Binary Data, UTF-8 Encoded String:
    ``name``). Raises :class:`MalformedPacket` when the length or the bytes run past the end."""
    if pos + 2 > len(buf):
        raise MalformedPacket(f"{name} length runs past the end of the packet")
    start = pos + 2
    end = start + ((buf[pos] << 8) | buf[pos + 1])
    if end > len(buf):
        raise MalformedPacket(f"{name} runs past the end of the packet")
    return bytes(buf[start:end]), end


def decode_binary(buf: bytes, pos: int) -> tuple[bytes, int]:
    """Decode Binary Data. Raises :class:`MalformedPacket` when the declared length runs past the end."""
    return _decode_prefixed(buf, pos, "Binary Data")


def encode_string(value: str) -> bytes:
    """Encode a UTF-8 Encoded String (MQTT 5.0 §1.5.4, MQTT 3.1.1 §1.5.3).

    Raises:
        ValueError: longer than 65,535 bytes once encoded.
    """
    return _encode_prefixed(value.encode("utf-8"), "UTF-8 Encoded String")


def check_string(value: str) -> None:
    """Check the content rules of a UTF-8 Encoded String.

    Raises:
        MalformedPacket: U+0000 [MQTT-1.5.4-2] or a surrogate code point [MQTT-1.5.4-1].
    """
    if "\x00" in value:
        raise MalformedPacket("UTF-8 Encoded String contains U+0000 [MQTT-1.5.4-2]")
    try:
        value.encode("utf-8")  # the codec refuses exactly the surrogates U+D800..U+DFFF
    except UnicodeEncodeError:
        raise MalformedPacket("UTF-8 Encoded String contains a surrogate code point [MQTT-1.5.4-1]") from None


def decode_string(buf: bytes, pos: int) -> tuple[str, int]:
    """Decode a UTF-8 Encoded String.

    Raises:
        MalformedPacket: the bytes are not well-formed UTF-8 (which includes encoded surrogates)
            [MQTT-1.5.4-1], contain U+0000 [MQTT-1.5.4-2], or run past the end of the packet.
    """
    # _decode_prefixed's checks, without its call and its copy of the bytes (every PUBLISH's topic comes here)
    start = pos + 2
    if start > len(buf):
        raise MalformedPacket("UTF-8 Encoded String length runs past the end of the packet")
    end = start + ((buf[pos] << 8) | buf[pos + 1])
    if end > len(buf):
        raise MalformedPacket("UTF-8 Encoded String runs past the end of the packet")
    try:
        value = buf[start:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedPacket(f"invalid UTF-8 in a UTF-8 Encoded String [MQTT-1.5.4-1]: {exc.reason}") from None
    if "\x00" in value:
        raise MalformedPacket("UTF-8 Encoded String contains U+0000 [MQTT-1.5.4-2]")
    return value, end
