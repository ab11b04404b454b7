"""The I/O glue alone (gateway/server/protocol.py): ``MQTTProtocol`` and ``BrokerIO`` driven by a fake transport that
records what is done to it, as uvicorn's protocol tests do. The core decides (the actions its inputs return: bytes to
write, a close or an abort, reading paused until a time or while a consumer is congested); these tests check that the
glue performs exactly that: one write per connection per loop turn, a FIN then a close for a connection the core
closed, an abort for a stuck one, and reading paused and resumed around a ``max_publish_rate`` pause. The transport
is the unit's boundary here, not a stand-in for a part of the broker: the broker, its core and the memory store are
real."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.broker.actions import ABORT, Action
from gateway.broker.broker import Broker
from gateway.broker.limits import BrokerSettings, ZoneLimits
from gateway.broker.session_state import Connection
from gateway.broker.store_port import MemoryStore
from gateway.mqtt.framing import PacketReader
from gateway.mqtt.packets import Connack, Connect, PubAck, Publish
from gateway.server import protocol as glue
from gateway.server.protocol import BrokerIO, MQTTProtocol


class FakeTransport:
    """An asyncio transport that records every call (``calls``) and the bytes written (``written``)."""

    def __init__(self, peer: Any = ("192.0.2.7", 40001), can_eof: bool = True) -> None:
        self.calls: list[str] = []
        self.written: list[bytes] = []
        self.closing = False
        self.reading = True
        self.limits: tuple[int, int] | None = None
        self._peer = peer
        self._can_eof = can_eof

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        self.calls.append(f"get_extra_info:{name}")
        return self._peer if name == "peername" else default

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        self.limits = (high, low)

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes) -> None:
        assert not self.closing, "written after close"
        self.calls.append("write")
        self.written.append(bytes(data))

    def can_write_eof(self) -> bool:
        return self._can_eof

    def write_eof(self) -> None:
        self.calls.append("write_eof")

    def is_closing(self) -> bool:
        return self.closing

    def _record(self, call: str, closing: bool | None = None, reading: bool | None = None) -> None:
        self.calls.append(call)
        if closing is not None:
            self.closing = closing
        if reading is not None:
            self.reading = reading

    def close(self) -> None:
        self._record("close", closing=True)

    def abort(self) -> None:
        self._record("abort", closing=True)

    def pause_reading(self) -> None:
        self._record("pause_reading", reading=False)

    def resume_reading(self) -> None:
        self._record("resume_reading", reading=True)


def _packets(transport: FakeTransport, version: int = 4) -> list[Any]:
    reader = PacketReader()
    reader.version = version
    return list(reader.feed(b"".join(transport.written)))


def _setup(limits: ZoneLimits | None = None, **fake: Any) -> tuple[Broker, BrokerIO, MQTTProtocol, FakeTransport]:
    broker = Broker(BrokerSettings(sys_interval=0), MemoryStore(), now=time.time())
    io = BrokerIO(broker, asyncio.get_running_loop())
    proto = MQTTProtocol(io, limits or ZoneLimits(), "test")
    transport = FakeTransport(**fake)
    proto.connection_made(transport)
    return broker, io, proto, transport


async def _turn() -> None:
    """Let the loop run the end-of-turn flush."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def _connected() -> tuple[Broker, BrokerIO, MQTTProtocol, FakeTransport, Connection]:
    """A connection whose CONNECT was accepted and its CONNACK written."""
    broker, io, proto, transport = _setup()
    proto.data_received(Connect(client_id="glue").encode(4))
    await _turn()
    assert proto.conn is not None
    return broker, io, proto, transport, proto.conn


async def test_connection_made_registers_the_peer_and_the_write_buffer_limits() -> None:
    broker, io, proto, transport = _setup(ZoneLimits(high_watermark=4096))
    assert proto.conn is not None and proto.conn.peer == "192.0.2.7:40001"
    assert io.transports == {proto.conn: transport}
    assert transport.limits == (4096, 1024)
    assert proto.conn in broker.connections


async def test_what_the_core_answers_is_written_once_at_the_end_of_the_turn() -> None:
    broker, _, proto, transport = _setup()
    proto.data_received(Connect(client_id="glue").encode(4))
    proto.data_received(b"".join(Publish("t", b"x", 1, packet_id=i).encode(4) for i in (1, 2, 3)))
    assert transport.written == []  # nothing before the end of the loop turn
    await _turn()
    assert transport.calls.count("write") == 1  # CONNACK and three PUBACKs share one write
    packets = _packets(transport)
    assert isinstance(packets[0], Connack) and packets[0].reason_code == 0
    assert [p.packet_id for p in packets[1:]] == [1, 2, 3] and all(isinstance(p, PubAck) for p in packets[1:])
    assert not broker.dirty and proto.conn is not None and proto.conn.out == []


async def test_a_connection_the_core_closed_gets_its_last_bytes_then_a_fin_then_a_close() -> None:
    _, _, proto, transport = _setup()
    proto.data_received(Publish("t", b"x", 0).encode(4))  # not CONNECT first [MQTT-3.1.0-1]: the core closes it
    assert proto.conn is not None and proto.conn.close_after_flush
    await _turn()
    assert "write_eof" in transport.calls and "close" not in transport.calls  # lingers, reading, for CLOSE_LINGER
    _, _, proto, transport = _setup(can_eof=False)  # a transport without half-close: closed at once
    proto.data_received(Publish("t", b"x", 0).encode(4))
    await _turn()
    assert transport.calls[-1] == "close"


async def test_the_linger_ends_in_a_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(glue, "CLOSE_LINGER", 0.01)
    _, _, proto, transport = _setup()
    proto.data_received(Connect(client_id="glue").encode(4) + b"\xe0\x00")  # CONNECT, then DISCONNECT
    await _turn()
    assert isinstance(_packets(transport)[0], Connack)
    await asyncio.sleep(0.05)
    assert transport.calls[-2:] == ["write_eof", "close"]


async def test_a_stuck_connection_the_core_aborts_is_aborted_without_writing() -> None:
    _, io, _, transport, conn = await _connected()
    # Output the core left, then gave up on (send_timeout): one action with both.
    io.perform([Action(conn, [b"\x30\x03\x00\x01t"], ABORT, "send_timeout")])
    io.flush()
    assert transport.calls[-1] == "abort" and transport.calls.count("write") == 1 and conn.out == []


async def test_a_rate_pause_pauses_reading_until_the_core_says_and_then_resumes() -> None:
    _, io, proto, transport = _setup(ZoneLimits(max_publish_rate=2))
    proto.data_received(Connect(client_id="glue").encode(4))
    proto.data_received(b"".join(Publish("t", b"x", 1, packet_id=i).encode(4) for i in range(1, 8)))
    conn = proto.conn
    assert conn is not None and conn.paused_until > time.time()
    assert transport.calls.count("pause_reading") == 1 and not transport.reading and conn in io.rate_paused
    deadline = time.monotonic() + 10
    while not transport.reading and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert transport.reading and conn not in io.rate_paused
    await _turn()  # the flush of the turn that handled the last PUBLISH
    # Each PUBLISH that waited for a token is handled when its pause ends, and reading stays paused (asyncio's
    # pause_reading is idempotent) until none waits: one resume, after the last pause.
    flow = [c for c in transport.calls if c.endswith("_reading")]
    assert flow[-1] == "resume_reading" and flow.count("resume_reading") == 1
    acks = [p.packet_id for p in _packets(transport) if isinstance(p, PubAck)]
    assert acks == list(range(1, 8))


async def test_connection_lost_tells_the_core_and_forgets_the_transport() -> None:
    broker, io, proto, transport, conn = await _connected()
    proto.connection_lost(None)
    assert conn not in broker.connections and io.transports == {} and proto.transport is None
    proto.data_received(b"\xc0\x00")  # late bytes after the close: nothing happens
    await _turn()
    assert transport.calls.count("write") == 1
