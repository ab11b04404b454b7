"""Issue 15, "Hostile clients": live tests against a real broker process on 127.0.0.1, each beside a well-behaved
QoS 1 pair (tests/bystanders.py) that must lose nothing. The same limits in process: tests/test_limits.py; the
fuzzer: tests/test_fuzz.py.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest
from bystanders import QoS1Pair
from helpers import BrokerProcess, RawClient
from test_isolation import sys_value

MakeBroker = Callable[[str], BrokerProcess]

CONFIG = """
[broker]
sys_interval = "1s"
[listeners.external]
bind = "127.0.0.1:0"
"""


def test_2000_half_open_connections_are_closed_by_connect_timeout(make_broker: MakeBroker, uid: str) -> None:
    """2,000 connections that send nothing, or half a CONNECT (slowloris), are all closed by ``connect_timeout``
    (2 s here) while the pair exchanges its messages; none is refused for it, the bystanders lose nothing."""
    broker = make_broker(CONFIG + 'connect_timeout = "2s"\n')
    pair = QoS1Pair(broker.port, uid, count=300, interval=0.01).start()
    half_connect = bytes((0x10, 40)) + b"\x00\x04MQTT\x04\x02\x00\x3c"  # announces 40 bytes, sends 12
    sockets: list[socket.socket] = []
    try:
        for i in range(2000):
            sock = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
            if i % 2:
                sock.sendall(half_connect)
            sockets.append(sock)
        opened = time.monotonic()
        open_left = len(sockets)
        deadline = opened + 15
        while open_left and time.monotonic() < deadline:
            time.sleep(0.5)
            open_left = 0
            for sock in sockets:
                sock.setblocking(False)
                try:
                    data = sock.recv(16)
                    if data:
                        open_left += 1  # the broker wrote something: not expected, counted as open
                except BlockingIOError:
                    open_left += 1
                except OSError:
                    pass
        assert open_left == 0, f"{open_left} of 2000 half-open connections still open after connect_timeout"
        assert time.monotonic() - opened >= 1.0  # closed by the timeout, not at once
        pair.finish()
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize("version", [4, 5])
def test_connection_flood_past_max_connections(make_broker: MakeBroker, uid: str, version: int) -> None:
    """``max_connections`` = 20 on the listener, the pair holding 2: 60 more clients connect; 18 are accepted,
    the other 42 get CONNACK 0x97 (3.1.1: 0x03) and are closed, counted on ``$SYS/broker/refused/max_connections``;
    the pair loses nothing, and once the flood leaves a new client gets in."""
    broker = make_broker(CONFIG + "max_connections = 20\n")
    pair = QoS1Pair(broker.port, uid, count=200).start()
    clients: list[RawClient] = []
    accepted = refused = 0
    for i in range(60):
        client = RawClient(broker.port, version=version)
        code = client.connect(f"{uid}-flood-{i}").reason_code
        if code == 0:
            accepted += 1
            clients.append(client)
        else:
            assert code == (0x97 if version == 5 else 0x03)
            assert client.closed_by_server()
            refused += 1
            client.close()
    assert (accepted, refused) == (18, 42)
    time.sleep(1.2)
    pair.finish()
    watcher_count = sys_value(broker.port, "refused/max_connections")  # the pair is gone: room for the watcher
    assert watcher_count == 42
    for client in clients:
        client.close()
    deadline = time.monotonic() + 5
    while True:  # the closes reach the broker within a loop turn or two
        late = RawClient(broker.port, version=version)
        code = late.connect(f"{uid}-late").reason_code
        late.close()
        if code == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert code == 0, "no room again after the flood left"
