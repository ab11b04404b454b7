"""Regression tests of what the fuzzer (tests/fuzzing.py) found."""

from __future__ import annotations

import pytest
from test_core import Client, make_broker

from gateway.broker.session import CLOSED, CONNECTED
from gateway.mqtt.packets import Connect, Disconnect
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import ReasonCode as RC


@pytest.mark.parametrize("level", [0x45, 7, 3])
def test_mqtt_3_1_0_2_second_connect_with_any_level_is_a_protocol_error(level: int) -> None:
    """Found by the fuzzer: a connected 5.0 client sending a second CONNECT with an unsupported Protocol Level got a
    3.1.1 CONNACK 0x01 (a CONNACK after its CONNACK, which a 5.0 client cannot even decode). A second CONNECT is a
    Protocol Error whatever its level [MQTT-3.1.0-2]: DISCONNECT 0x82 and the close; other clients unaffected."""
    broker = make_broker()
    other = Client(broker, 5)
    other.connect("other")
    client = Client(broker, 5)
    client.connect("c")
    second = bytearray(Connect("c", 4).encode(4))
    second[8] = level
    client.send_bytes(bytes(second))
    assert client.read() == [Disconnect(RC.PROTOCOL_ERROR, {P.REASON_STRING: "a second CONNECT on the same "
                                                              "connection [MQTT-3.1.0-2]"})]
    assert client.conn.state == CLOSED and other.conn.state == CONNECTED
