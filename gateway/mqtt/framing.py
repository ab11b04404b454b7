"""Incremental framing: feed bytes from the network, get whole decoded packets (MQTT 5.0 §2.1).

A partial frame never raises: its bytes wait for the next :meth:`PacketReader.feed`. A declared Remaining
Length above the Maximum Packet Size raises before any of the body is buffered, so a peer cannot make the
reader hold more than ``max_packet_size`` bytes.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Final

from gateway.mqtt.errors import MalformedPacket, PacketTooLarge
from gateway.mqtt.packets import MQTT_3_1_1, Connect, Packet, decode_packet

#: The largest packet MQTT can frame: 1 + 4 + 268,435,455 bytes (MQTT 5.0 §2.1.4).
ABSOLUTE_MAX_PACKET_SIZE: Final = 268_435_460


class PacketReader:
    """Splits a byte stream into packets and decodes them.

    Attributes:
        version: the Protocol Level used to decode; set from the first CONNECT seen (3, 4 or 5).
        max_packet_size: the largest whole packet accepted, in bytes (fixed header included).
    """

    __slots__ = ("_buf", "_need", "max_packet_size", "version")

    def __init__(self, max_packet_size: int = ABSOLUTE_MAX_PACKET_SIZE, version: int = MQTT_3_1_1) -> None:
        self._buf: bytes | bytearray = b""
        self._need = 0  # bytes the partial packet in _buf needs before it is whole (0 = unknown)
        self.max_packet_size = max_packet_size
        self.version = version

    @property
    def buffered(self) -> int:
        """Bytes held that do not make a whole packet yet."""
        return len(self._buf)

    def leading_pubacks(self, data: bytes) -> tuple[list[int], int]:
        """The Packet Identifiers of the run of plain PUBACKs that starts ``data`` and how many bytes it takes:
        :meth:`leading_acks` for PUBACK (0x40)."""
        return self.leading_acks(data, 0x40)

    def leading_acks(self, data: bytes, first: int) -> tuple[list[int], int]:
        """The Packet Identifiers of the run of plain acknowledgements of one kind that starts ``data`` (4 bytes
        each: ``first``, the first byte of PUBACK 0x40, PUBREC 0x50, PUBREL 0x62 or PUBCOMP 0x70, then Remaining
        Length 2 and a non-zero Packet Identifier; MQTT 5.0 §3.4.2.1: Reason Code 0 left out), and how many bytes
        that run takes. A client's acknowledgements arrive as such runs; this reads them without making a packet
        object each. Returns ``([], 0)`` while a partial packet is buffered (the bytes belong to it) and stops
        before anything else, including an acknowledgement with Packet Identifier 0, which :meth:`feed` then
        rejects [MQTT-2.2.1-3]."""
        if self._buf:
            return [], 0
        pids: list[int] = []
        pos = 0
        end = len(data) - 3
        while pos < end and data[pos] == first and data[pos + 1] == 2:
            pid = (data[pos + 2] << 8) | data[pos + 3]
            if not pid:
                break
            pids.append(pid)
            pos += 4
        return pids, pos

    def feed(self, data: bytes) -> Generator[Packet, None, None]:
        """Add ``data`` and yield every whole packet now available, in order.

        The error for a bad packet is raised after the good packets before it were yielded; the
        reader must not be fed again after it raised.

        Raises:
            MalformedPacket: a Remaining Length over 4 bytes or any decoding error of a whole packet.
            PacketTooLarge: a declared packet size above ``max_packet_size`` [MQTT-3.2.2-15] / [MQTT-3.1.2-24].
            ProtocolError, UnsupportedProtocolVersion, MQTTError: from :func:`decode_packet`.
        """
        if self._buf:
            if self._need and len(self._buf) + len(data) < self._need:
                # Still short of a whole (large) packet: append in place, amortised O(1) per byte.
                if not isinstance(self._buf, bytearray):
                    self._buf = bytearray(self._buf)
                self._buf += data
                return
            buf = bytes(self._buf) + data
        else:
            buf = data
        self._need = 0
        end = len(buf)
        pos = 0
        limit = self.max_packet_size
        try:
            while pos < end:
                # Fixed header: type/flags byte, then 1-4 byte Remaining Length.
                if pos + 1 >= end:
                    break
                first = buf[pos]
                byte = buf[pos + 1]
                if byte < 128:
                    length = byte
                    hdr = 2
                else:
                    length = byte & 0x7F
                    shift = 7
                    hdr = 2
                    complete = False
                    while True:
                        if pos + hdr >= end:
                            break
                        byte = buf[pos + hdr]
                        hdr += 1
                        length |= (byte & 0x7F) << shift
                        if byte < 128:
                            complete = True
                            break
                        shift += 7
                        if hdr > 4:
                            raise MalformedPacket("Remaining Length longer than 4 bytes [MQTT-1.5.5-1]")
                    if not complete:
                        break
                if hdr + length > limit:
                    raise PacketTooLarge(
                        f"packet of {hdr + length} bytes exceeds the Maximum Packet Size of {limit} bytes"
                    )
                start = pos + hdr
                stop = start + length
                if stop > end:
                    self._need = hdr + length
                    break
                pos = stop
                packet = decode_packet(first, buf[start:stop], self.version)
                if isinstance(packet, Connect):
                    # 3 stays 3: MQTT 3.1 is decoded as 3.1.1 but for its fixed-header flags (decode_packet)
                    self.version = packet.protocol_level
                yield packet
        finally:
            self._buf = buf[pos:] if pos < end else b""
