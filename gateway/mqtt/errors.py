"""Errors raised by the sans-I/O MQTT codec."""

from __future__ import annotations

from gateway.mqtt.reason_codes import ReasonCode


class MQTTError(Exception):
    """A packet (or byte stream) that breaks the protocol.

    Attributes:
        reason_code: the MQTT 5.0 reason code the receiver sends in its DISCONNECT (or CONNACK) before it closes
            the Network Connection (MQTT 5.0 §4.13); for 3.1.1 the connection is simply closed.
    """

    def __init__(self, reason_code: ReasonCode, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code


class MalformedPacket(MQTTError):
    """A packet that cannot be parsed as the spec defines it (reason code 0x81, MQTT 5.0 §4.13.1)."""

    def __init__(self, message: str) -> None:
        super().__init__(ReasonCode.MALFORMED_PACKET, message)


class ProtocolError(MQTTError):
    """A well-formed packet that is not allowed here (reason code 0x82, MQTT 5.0 §4.13.1)."""

    def __init__(self, message: str) -> None:
        super().__init__(ReasonCode.PROTOCOL_ERROR, message)


class PacketTooLarge(MQTTError):
    """A packet larger than the Maximum Packet Size (reason code 0x95, MQTT 5.0 §3.1.2.11.4)."""

    def __init__(self, message: str) -> None:
        super().__init__(ReasonCode.PACKET_TOO_LARGE, message)


class UnsupportedProtocolVersion(MQTTError):
    """A CONNECT whose protocol name or level this server does not speak (MQTT 5.0 §3.1.2.2, [MQTT-3.1.2-2]).

    Attributes:
        level: the Protocol Level byte received, or ``None`` when the Protocol Name itself was wrong.
    """

    def __init__(self, message: str, level: int | None) -> None:
        super().__init__(ReasonCode.UNSUPPORTED_PROTOCOL_VERSION, message)
        self.level = level
