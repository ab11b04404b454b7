"""Long names in the LMDB store: no Client Identifier, Topic Filter or topic can make a commit fail.

LMDB refuses keys longer than 511 bytes (MDB_BAD_VALSIZE), and one refused key used to fail the whole group commit:
every other client's changes in it were dropped and the store reported itself full. Names longer than 160 bytes are
now hashed to a fixed 161-byte key part (``records.name_key``) with the full name kept in the row's value where the
loader needs it; a change that still fails alone is left out of its commit, and only its owner is disconnected.

Tested on a real broker subprocess with real LMDB files next to a well-behaved QoS 1 pair (tests/bystanders.py),
across a restart, and on the store directly (a failing change injected into a batch).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bystanders import QoS1Pair
from held_acks import HeldAcks
from helpers import BrokerProcess, RawClient

from gateway.broker.limits import ZoneLimits
from gateway.broker.message import Delivery, Message
from gateway.broker.session_state import NEVER, Session
from gateway.broker.subscription_tree import SubscriptionRecord
from gateway.mqtt.packets import Disconnect, Packet, PubAck, Publish, Suback, Subscribe, Subscription
from gateway.mqtt.properties import PropertyId as P
from gateway.store import records as rec
from gateway.store.lmdb_store import LmdbStore, StoreSettings
from gateway.store.tables import DB_NAMES, Tables
from gateway.store.writer import _PUT

# max_clientid_len is raised so that the long Client Identifiers reach the store: the point here is that no name,
# whatever the limits at the protocol edge, can poison a commit.
CONFIG = """
[broker]
sys_interval = 0

[listeners.external]
bind = "127.0.0.1:0"
max_clientid_len = 65535
max_topic_length = 65535
"""

ID_600 = "hostile-" + "c" * 592  # 600 bytes
ID_5000 = "hostile-" + "\u00fc" * 2496  # 5000 bytes: 2-byte characters, so the hashed form's head is cut on a boundary
FILTER_5000 = "long/" + "f" * 4995  # a Topic Filter of 5000 bytes (also the Topic Name published to)
RETAINED_5000 = "kept/" + "r" * 4995  # a retained message's topic, 5000 bytes
SEI = 3600
MAX_KEY = 511  # LMDB's default maximum key size


def _connect(port: int, client_id: str, clean: bool = False) -> tuple[RawClient, bool]:
    client = RawClient(port, version=5, timeout=5.0)
    connack = client.connect(client_id, clean_start=clean, properties={P.SESSION_EXPIRY_INTERVAL: SEI})
    assert connack.reason_code == 0, connack
    return client, connack.session_present


def _reply(client: RawClient, kind: type[Packet]) -> Packet:
    """The next packet of ``kind``; PUBLISH packets arriving meanwhile (a session's queued messages) are
    acknowledged and kept in ``client._pending`` order for :func:`_drain`."""
    held: list[Packet] = []
    try:
        while True:
            packet = client.recv()
            if isinstance(packet, kind):
                return packet
            assert isinstance(packet, Publish), packet
            held.append(packet)
    finally:
        client._pending[:0] = held


def _subscribe(client: RawClient, pid: int, topic_filter: str) -> None:
    client.send(Subscribe(pid, [Subscription(topic_filter, 1)]))
    suback = _reply(client, Suback)
    assert isinstance(suback, Suback) and suback.packet_id == pid and suback.reason_codes == [1], suback


def _publish(client: RawClient, pid: int, topic: str, payload: bytes, retain: bool = False) -> None:
    client.send(Publish(topic, payload, 1, retain, packet_id=pid))
    ack = _reply(client, PubAck)
    assert isinstance(ack, PubAck) and ack.packet_id == pid and ack.reason_code in (0, 0x10), ack


def _drain(client: RawClient, quiet: float = 0.5) -> list[Publish]:
    got: list[Publish] = []
    while True:
        try:
            packet = client.recv(quiet)
        except TimeoutError:
            return got
        assert isinstance(packet, Publish), packet
        got.append(packet)
        if packet.qos:
            client.send(PubAck(packet.packet_id))  # type: ignore[arg-type]


def _bye(client: RawClient) -> None:
    client.send(Disconnect())
    assert client.closed_by_server()
    client.close()


def _store_cli(workdir: Path, action: str, *extra: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "store", action, "--config", "gateway.toml", *extra],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_long_client_ids_filters_and_retained_topics_never_fail_a_commit_and_survive_restart(tmp_path: Path) -> None:
    """Persistent sessions with a 600-byte and a 5000-byte Client Identifier, each subscribed to a 5000-byte Topic
    Filter, reconnect, subscribe and publish (QoS 1, retained, on a 5000-byte topic) three times while a QoS 1 pair
    exchanges 300 messages: every SUBACK/PUBACK comes, the pair loses nothing, nothing is refused as "store full".
    After a SIGTERM restart on the same store, both sessions come back (Session Present) with their queued
    messages and their subscription under the full names, the retained message keeps its full topic, and
    ``store inspect``/``store stats`` show the full names."""
    broker = BrokerProcess(CONFIG, workdir=str(tmp_path)).start()
    queued: list[bytes] = []
    try:
        port = broker.port
        pair = QoS1Pair(port, "names", count=300, interval=0.004).start()
        publisher, _ = _connect(port, "names-publisher", clean=True)
        pid = 0
        for round_ in range(3):
            for cid in (ID_600, ID_5000):
                client, present = _connect(port, cid)
                assert present is (round_ > 0), (cid[:20], round_, present)
                pid += 1
                _subscribe(client, pid, FILTER_5000)
                pid += 1
                _publish(client, pid, RETAINED_5000, f"retained {round_} {cid[:9]}".encode(), retain=True)
                _drain(client, quiet=0.2)
                _bye(client)
            for n in range(5):  # queued for both offline sessions
                pid += 1
                payload = f"queued {round_}.{n}".encode()
                _publish(publisher, pid, FILTER_5000, payload)
                queued.append(payload)
        # Only the last round's messages are still queued: each reconnect drained the earlier ones.
        queued = queued[-5:]
        _bye(publisher)
        pair.finish()
        assert not [line for line in broker.lines if "store full" in line or "store write failed" in line], broker.log()
    finally:
        code = broker.stop()
    assert code == 0, broker.log()

    # The tools show the full names (the broker is stopped: they take the store's lock).
    inspect = _store_cli(tmp_path, "inspect")
    assert f"session {ID_600!r}" in inspect and f"session {ID_5000!r}" in inspect, inspect[:2000]
    assert inspect.count(f"subscription {FILTER_5000!r}") == 2, inspect[:2000]
    assert f"retained {RETAINED_5000!r}" in inspect, inspect[:2000]
    depths = json.loads(_store_cli(tmp_path, "stats", "--json"))["queue_depths"]
    assert depths[ID_600] == len(queued) and depths[ID_5000] == len(queued), {k[:20]: v for k, v in depths.items()}

    broker = BrokerProcess(CONFIG, workdir=str(tmp_path)).start()
    clients: list[RawClient] = []
    try:
        port = broker.port
        for cid in (ID_600, ID_5000):
            client, present = _connect(port, cid)
            clients.append(client)
            assert present is True, cid[:20]
            got = _drain(client)
            assert [(p.topic, p.payload) for p in got] == [(FILTER_5000, q) for q in queued], (cid[:20], got)
        # The subscriptions came back too: a new message reaches both without subscribing again.
        publisher, _ = _connect(port, "names-publisher", clean=True)
        clients.append(publisher)
        _publish(publisher, 1, FILTER_5000, b"after restart")
        for client in clients[:2]:
            got = _drain(client)
            assert [(p.topic, p.payload) for p in got] == [(FILTER_5000, b"after restart")], got
        # The retained message, with its full topic.
        watcher, _ = _connect(port, "names-watcher", clean=True)
        clients.append(watcher)
        _subscribe(watcher, 1, "kept/#")
        got = _drain(watcher)
        assert [(p.topic, p.payload, p.retain) for p in got] == [(RETAINED_5000, b"retained 2 hostile-\xc3\xbc", True)]
    finally:
        for client in clients:
            client.close()
        code = broker.stop()
    assert code == 0, broker.log()


# ------------------------------------------------------------------------------------------------ the store alone


def _open(path: Path, **kw: Any) -> tuple[LmdbStore, Any]:
    store = LmdbStore(StoreSettings(path=str(path), mqueue_mem_len=0, **kw), ZoneLimits)
    state = store.load(0.0)
    return store, state  # no event loop attached: every change commits synchronously


def test_tables_iterate_in_the_order_of_db_names() -> None:
    """``Tables`` spells its handles out for speed (``__iter__``); they follow its fields, which make ``DB_NAMES``."""
    tables = Tables(*DB_NAMES)
    assert tuple(tables) == DB_NAMES and [name for name, _ in tables.items()] == list(DB_NAMES)
    assert all(tables.name_of(name) == name for name in DB_NAMES)


def _rows(store: LmdbStore, table: str) -> dict[bytes, bytes]:
    """The rows of ``table`` (a name of ``tables.DB_NAMES``)."""
    assert store.env is not None
    with store.env.begin() as txn:
        return {bytes(k): bytes(v) for k, v in txn.cursor(db=getattr(store.tables, table))}


@pytest.mark.parametrize("mode", ["synchronous", "writer thread"])
def test_a_change_that_fails_alone_is_left_out_and_its_owners_reported_the_rest_committed(
    tmp_path: Path, mode: str
) -> None:
    """One batch holds changes of several clients and two that LMDB refuses (a key LMDB cannot take: an empty
    retained topic from publisher "careless", and a row of session "x" * 300 with a 600-byte key): the writer
    commits every other change, reports the owners ("careless", and the 300-byte client id read back from its
    hashed key) before the batch's callbacks run, counts both, and the message reference counts stay right (a
    message queued for two sessions is removed with its last queue row). ``synchronous``: no event loop (tools,
    commits in the caller); ``writer thread``: as in the broker, one loop turn's changes committed by the writer."""
    store, _ = _open(tmp_path / "store")
    loop = asyncio.new_event_loop()
    events: list[Any] = []
    store.on_change_failed = lambda ids: events.append(("failed", sorted(ids)))
    long_id = "x" * 300
    try:
        for cid in ("a", "b", long_id):
            store.session_saved(Session(cid, ZoneLimits(), expiry_interval=NEVER))
        if mode == "writer thread":
            store.attach(loop)
        else:
            store._submit_scheduled = True  # hold the changes below in one batch (as one loop turn does)
        store.subscription_saved("a", SubscriptionRecord("a", "t/#", 1, False, False, 0, None, None))
        shared = Message(1, "t/1", b"shared", 1, False, {}, 0.0, None, "p")
        deliveries = {cid: Delivery(shared, 1) for cid in ("a", "b")}
        for cid, delivery in deliveries.items():
            store.delivery_saved(cid, delivery)
        store.retained_saved(Message(2, "", b"no topic", 1, True, {}, 0.0, None, "careless"))
        # No key builder makes this one:
        store._record((_PUT, store.tables.subs, store._prefix(long_id) + b"f" * 600, b"\x01" * 8))
        store.retained_saved(Message(3, "t/kept", b"kept", 1, True, {}, 0.0, None, "p"))
        held = HeldAcks(store)
        held.events = events
        if mode == "writer thread":
            held.wait("acknowledged")
            loop.run_until_complete(_until(lambda: "acknowledged" in events))
        else:
            held.wait("acknowledged")
            store._submit_scheduled = False
            store._schedule()  # commits the batch in this thread, then reports the barrier
        assert events == [("failed", ["careless", long_id]), "acknowledged"], events
        assert store.failed_changes == 2
        sessions = _rows(store, "sessions")
        assert {rec.session_id(k, v)[0] for k, v in sessions.items()} == {"a", "b", long_id}
        assert list(_rows(store, "subs")) == [rec.client_prefix("a") + b"t/#"]
        assert len(_rows(store, "queue")) == 2 and sorted(_rows(store, "messages")) == [rec.u64(1), rec.u64(3)]
        assert list(_rows(store, "retained")) == [b"t/kept"] and store._applier.refs == {1: 2}
        assert not store.last_write_failed and store.has_room(None)
        # The reference counts are right: the shared message row goes with its last queue row.
        store.delivery_deleted("a", deliveries["a"])
        _settle(store, loop)
        assert sorted(_rows(store, "messages")) == [rec.u64(1), rec.u64(3)]
        store.delivery_deleted("b", deliveries["b"])
        _settle(store, loop)
        assert sorted(_rows(store, "messages")) == [rec.u64(3)] and _rows(store, "queue") == {}
    finally:
        _settle(store, loop)
        store.close()
        loop.close()


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


def _settle(store: LmdbStore, loop: asyncio.AbstractEventLoop) -> None:
    """Wait until every recorded change is committed (a no-op without an event loop: commits are synchronous)."""
    if store.loop is not None:
        loop.run_until_complete(_until(lambda: not store.pending()))


def test_keys_stay_within_lmdb_limits_and_long_names_load_in_full(tmp_path: Path) -> None:
    """Every key the store writes for 600- and 5000-byte names fits LMDB (at most 323 bytes); the hashed key parts
    of two names that share their first 96 bytes differ; sessions, subscriptions, queued and inbound QoS 2 messages
    and retained messages load back under their full names."""
    path = tmp_path / "store"
    store, _ = _open(path)
    ids = [ID_600, ID_5000, ID_5000[:-1] + "\u00fd"]  # the last two differ only in their last character
    try:
        for cid in ids:
            store.session_saved(Session(cid, ZoneLimits(), expiry_interval=NEVER))
            store.subscription_saved(cid, SubscriptionRecord(cid, FILTER_5000, 1, False, False, 0, 7, None))
            store.delivery_saved(cid, Delivery(Message(10, FILTER_5000, cid.encode()[:50], 1, False, {}, 0.0), 1))
            store.inbound_saved(cid, 5, Message(20, FILTER_5000, b"qos2", 2, False, {}, 0.0, None, cid))
        store.retained_saved(Message(30, RETAINED_5000, b"kept", 1, True, {}, 0.0))
        HeldAcks(store).wait(None)
        keys = [k for table in DB_NAMES[2:] for k in _rows(store, table)]
        assert keys and max(map(len, keys)) <= 323 < MAX_KEY
        assert len({k for k in _rows(store, "sessions")}) == 3
    finally:
        store.close()
    store, state = _open(path)
    try:
        loaded = {s.client_id: s for s in state.sessions}
        assert sorted(loaded) == sorted(ids)
        for cid, session in loaded.items():
            assert list(session.subscriptions) == [FILTER_5000] and session.subscriptions[FILTER_5000].sub_id == 7
            assert [(d.message.topic, d.message.payload) for d in session.mqueue] == [(FILTER_5000, cid.encode()[:50])]
            assert {pid: m.topic for pid, (m, _t) in session.awaiting_rel.items()} == {5: FILTER_5000}
        assert [(m.topic, m.payload) for m in state.retained] == [(RETAINED_5000, b"kept")]
    finally:
        store.close()


def test_a_format_2_store_with_names_over_160_bytes_is_rewritten_to_format_3_and_loads_the_same(tmp_path: Path) -> None:
    """A store written before names were hashed (format 2: keys hold names as they are, up to LMDB's 511 bytes)
    is rewritten on open: every key part longer than 160 bytes becomes the hashed form, so the rows and the
    broker's later writes (which use that form) agree; sessions, subscriptions, queue, inbound and retained rows
    load the same, and deleting the session removes all of its rows."""
    path = tmp_path / "store"
    store, _ = _open(path)
    cid, topic_filter, topic = "o" * 250, "of/" + "g" * 250, "ot/" + "h" * 300
    message = Message(5, topic, b"old", 1, True, {}, 0.0)
    session = Session(cid, ZoneLimits(), expiry_interval=NEVER)
    assert store.env is not None
    t = store.tables
    meta, messages, sessions_db, subs_db, queue_db, inbound_db, retained_db = (
        t.meta, t.messages, t.sessions, t.subs, t.queue, t.inbound, t.retained)
    with store.env.begin(write=True) as txn:  # the rows as format 2 wrote them
        txn.put(b"format", b"2", db=meta)
        txn.put(b"next_mid", b"6", db=meta)
        txn.put(cid.encode(), rec.encode_session(session), db=sessions_db)
        record = SubscriptionRecord(cid, topic_filter, 1, False, False, 0, None, None)
        txn.put(cid.encode() + b"\x00" + topic_filter.encode(), rec.encode_subscription(record), db=subs_db)
        txn.put(rec.u64(5), rec.encode_message(message), db=messages)
        txn.put(cid.encode() + b"\x00" + rec.u64(1), rec.encode_delivery(Delivery(message, 1)), db=queue_db)
        txn.put(cid.encode() + b"\x00" + (9).to_bytes(2, "big"), rec.encode_inbound(5, 0.0), db=inbound_db)
        txn.put(topic.encode(), rec.u64(5), db=retained_db)
    store.close()

    store, state = _open(path)
    try:
        (loaded,) = state.sessions
        assert loaded.client_id == cid and list(loaded.subscriptions) == [topic_filter]
        assert [d.message.payload for d in loaded.mqueue] == [b"old"] and list(loaded.awaiting_rel) == [9]
        assert [m.topic for m in state.retained] == [topic]
        assert _rows(store, "meta")[b"format"] == str(rec.FORMAT_VERSION).encode() == b"3"
        for table in ("sessions", "subs", "queue", "inbound", "retained"):
            for key in _rows(store, table):
                part, rest = rec.split_key(key)
                assert len(part) <= rec.HASHED_LEN, (table, key[:40])
                assert table != "subs" or len(rest) <= rec.HASHED_LEN, (table, key[:40])
        assert rec.name_key(cid) in _rows(store, "sessions")
        store.session_deleted(cid)
        store.retained_deleted(topic)
        HeldAcks(store).wait(None)
        assert [len(_rows(store, table)) for table in DB_NAMES[1:7]] == [0] * 6
    finally:
        store.close()
