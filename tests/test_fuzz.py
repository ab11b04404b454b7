"""Hostile clients and fuzzing: a short run of the in-process fuzz target (tests/fuzzing.py) in
``make test``, driven by hypothesis, and the regression tests of what the fuzzer found. The long run is ``make
fuzz`` (atheris/libFuzzer, tests/fuzz_main.py, at least 1,000,000 inputs: docs/reliability.md, "Fuzzing").
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest
from fuzzing import run_input
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core import Client, make_broker

from gateway.broker.connection_states import CLOSED, CONNECTED
from gateway.broker.limits import ZoneLimits
from gateway.mqtt.packets import Connect, Disconnect, PubAck, Publish, Subscribe, Subscription
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import ReasonCode as RC


@pytest.fixture(autouse=True)
def _quiet() -> None:
    """The broker logs every protocol error it is fed; thousands of lines would only slow the run down."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


@settings(max_examples=1500, deadline=None, derandomize=False, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.binary(min_size=0, max_size=600))
def test_fuzz_broker_short_run(data: bytes) -> None:
    """1,500 hypothesis inputs (about 5 s): no exception escapes the broker, every invariant holds, the
    well-behaved pair loses nothing (tests/fuzzing.py says which)."""
    run_input(data)


def test_fuzz_random_inputs_bounded_in_time() -> None:
    """Random inputs for 10 s (at most 20,000), seeded so a failure repeats: lengths hypothesis rarely draws."""
    rng = random.Random(15)
    deadline = time.monotonic() + 10
    for _ in range(20_000):
        if time.monotonic() > deadline:
            break
        run_input(rng.randbytes(rng.randrange(100, 1200)))


@pytest.fixture(scope="module")
def store_dir() -> Iterator[str]:
    """A directory for the fuzzer's LMDB stores: in /dev/shm where there is one (a commit's fsync is free there;
    each input commits every change alone), removed afterwards."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix="edge-gateway-fuzz-", dir=shm)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@settings(max_examples=120, deadline=None, derandomize=False, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.binary(min_size=0, max_size=600))
def test_fuzz_broker_on_a_real_lmdb_store_short_run(store_dir: str, data: bytes) -> None:
    """The fuzz target on the real LmdbStore (tests/fuzzing.py, ``store_dir``): 120 hypothesis inputs (about 4 s),
    the same invariants with the store's rows read from LMDB key by key, queues paged to LMDB and back, and a
    restart from the store at the end of each input restoring the same sessions, queues and retained messages."""
    run_input(data, store_dir)


def test_fuzz_random_inputs_on_a_real_lmdb_store(store_dir: str) -> None:
    """Seeded random inputs on the real LmdbStore for 5 s (at most 1,000)."""
    rng = random.Random(1515)
    deadline = time.monotonic() + 5
    runs = 0
    for runs in range(1, 1001):  # noqa: B007
        run_input(rng.randbytes(rng.randrange(100, 1200)), store_dir)
        if time.monotonic() > deadline:
            break
    assert runs >= 10
    assert os.listdir(store_dir) in ([], [".store.lock"])  # each input's store removed


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


def test_mqtt_3_3_4_9_resumed_session_resends_no_more_than_receive_maximum() -> None:
    """[MQTT-3.3.4-9]: the Server must not send more QoS 1/2 PUBLISH packets than the client's Receive Maximum
    unacknowledged. A 3.1.1 persistent session with two messages in flight, resumed by 5.0 with Receive Maximum 1,
    must get one of them now and the other once it acknowledged the first."""
    broker = make_broker()
    limits = ZoneLimits(max_inflight=2)
    sub = Client(broker, 4, limits)
    sub.connect("s", clean_start=False)
    sub.send(Subscribe(1, [Subscription("t", 1)]))
    sub.read()
    pub = Client(broker, 4)
    pub.connect("p")
    for pid in (1, 2):
        pub.send(Publish("t", b"m", 1, packet_id=pid))
    assert len(sub.read()) == 2
    broker.connection_lost(sub.conn, 1.0)
    back = Client(broker, 5, limits)
    back.connect("s", clean_start=False, properties={P.SESSION_EXPIRY_INTERVAL: 60, P.RECEIVE_MAXIMUM: 1})
    first = back.read()
    assert len(first) == 1, first
    back.send(PubAck(first[0].packet_id))  # type: ignore[union-attr]
    assert len(back.read()) == 1
