"""The broker core: an MQTT 3.1.1 + 5.0 broker as a sans-I/O state machine; this module is its dispatcher.

The I/O layer calls :meth:`Broker.open` for a new Network Connection, :meth:`Broker.receive` with the bytes it
read, :meth:`Broker.connection_lost` when the peer went away, :meth:`Broker.tick` about once a second and
:meth:`Broker.committed` / :meth:`Broker.failed` with the store's commit reports, always with ``now`` (wall-clock
seconds, so expiry survives restarts). Each input returns what the I/O layer must do, one
:class:`~gateway.broker.actions.Action` per connection concerned: the packets to write, a close (after them, or at
once) with its reason, reading paused until a time. An action with ``more`` set says part of the bytes waits (the
rest of a long run of PUBACKs): the I/O layer writes that connection's packets now and calls
:meth:`Broker.resume`; one paused until a time gets :meth:`Broker.pause_over` then.

Each control packet has one handler, in the module of its concept (docs/architecture.md): CONNECT in
:mod:`~gateway.broker.connect`, PUBLISH in :mod:`~gateway.broker.inbound` (and :mod:`~gateway.broker.qos2`),
acknowledgements of the Inflight Window in :mod:`~gateway.broker.inflight`, SUBSCRIBE/UNSUBSCRIBE in
:mod:`~gateway.broker.subscribe`; routing in :mod:`~gateway.broker.router`, delivery and the Message Queue in
:mod:`~gateway.broker.delivery`, sessions and Wills in :mod:`~gateway.broker.session_lifecycle`, deadlines in
:mod:`~gateway.broker.timers`, what each protocol level may answer in :mod:`~gateway.broker.reasons`.

Sources: MQTT 3.1.1 and 5.0 (OASIS); the Inflight Window, Message Queue, QoS flows and offline messages as
docs/architecture.md's "Session semantics" gives them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

from gateway import __version__
from gateway.broker import (
    access_decisions,
    commits,
    connect,
    delivery,
    inbound,
    inflight,
    qos2,
    router,
    session_lifecycle,
    subscribe,
    timers,
)
from gateway.broker.actions import NO_ACTIONS, UNTIL_RELEASED, Action
from gateway.broker.connection_states import AWAITING_CONNECT, CLOSED, CONNECTED, HELD
from gateway.broker.deadlines import next_check
from gateway.broker.inflight import ACK_RUN_PART, on_pubacks
from gateway.broker.limits import BrokerSettings, ZoneLimits
from gateway.broker.message import Message
from gateway.broker.native_classes import mypyc_attr
from gateway.broker.output import hand_out, send, send_raw
from gateway.broker.ratelog import peer_host
from gateway.broker.reasons import connack_refusal_packet, disconnect, unsupported_version_connack
from gateway.broker.session_state import NEVER, NO_ACKS, Connection
from gateway.broker.state import BrokerState, Stats
from gateway.broker.store_port import SessionStore
from gateway.mqtt.errors import MQTTError, ProtocolError, UnsupportedProtocolVersion
from gateway.mqtt.packets import MQTT_5, PACKET_NAMES, Auth, Connect, Disconnect, PingReq, PingResp
from gateway.mqtt.properties import PropertyId as P
from gateway.mqtt.reason_codes import ReasonCode as RC

__all__ = ["Broker", "Stats"]

log: Final = logging.getLogger("gateway.broker")


#: Runs of plain QoS 2 acknowledgements by first byte (PUBREC, PUBREL, PUBCOMP): the handler of a whole run.
_ACK_RUNS: Final[dict[int, Callable[[BrokerState, Connection, list[int], float], None]]] = {
    0x50: inflight.on_pubrecs,
    0x62: qos2.on_pubrels,
    0x70: inflight.on_pubcomps,
}


# Compiled, a native class; tests and benchmarks subclass it in Python (tests/recording_broker.py, bench/).
@mypyc_attr(allow_interpreted_subclasses=True)
class Broker(BrokerState):
    """An MQTT 3.1.1 + 5.0 broker as a state machine: bytes in, packets out, no I/O.

    Args:
        settings: broker-wide settings and per-zone limits.
        store: where persistent sessions and retained messages are recorded (default: memory only).
        now: wall-clock seconds at start.
    """

    def __init__(self, settings: BrokerSettings | None = None, store: SessionStore | None = None, now: float = 0.0):
        super().__init__(settings, store, now)
        self._handlers: dict[int, Callable[[BrokerState, Connection, Any, float], None]] = {
            3: inbound.on_publish,
            4: inflight.on_completion,
            5: inflight.on_pubrec,
            6: qos2.on_pubrel,
            7: inflight.on_completion,
            8: subscribe.on_subscribe,
            10: subscribe.on_unsubscribe,
            12: _on_pingreq,
            14: _on_disconnect,
            15: _on_auth,
        }
        self._restore(now)

    def _restore(self, now: float) -> None:
        state = self.store.load(now)
        self.next_mid = max(self.next_mid, state.next_mid)
        for message in state.retained:
            self.retained.set(message)
        for session in state.sessions:
            self.sessions[session.client_id] = session
            self.persistent_count += session.persistent
            for record in session.subscriptions.values():
                self.tree.add(record)
            if session.expires_at is None and session.expiry_interval != NEVER:
                session.expires_at = now + session.expiry_interval
            self.offline.add(session)
            if session.will is not None and session.will_at is not None:
                self.wills.add(session)
        if self.read_checks:  # their ACL rules and subscription decisions
            for session in state.sessions:
                access_decisions.restore_rules(self, session)
        if state.sessions or state.retained:
            log.info(
                "restored %d persistent sessions and %d retained messages from the store",
                len(state.sessions),
                len(state.retained),
            )

    # ------------------------------------------------------------------------------------------ I/O entry points

    def open(self, limits: ZoneLimits, listener: str, peer: str, now: float) -> Connection:
        """Register a new Network Connection accepted on ``listener`` from ``peer``."""
        conn = Connection(limits, listener, peer, now)
        self.connections[conn] = None
        self.deadlines.schedule(conn, now + limits.connect_timeout)
        self.stats.connections_total += 1
        return conn

    def accepted_at(self, conn: Connection, at: float, cert_cn: str | None = None) -> None:
        """``conn`` was accepted at ``at`` (wall-clock seconds), before :meth:`open` (a TLS handshake or a
        WebSocket upgrade came first): its CONNECT timeout counts from then. ``cert_cn``: the CN of the client
        certificate the TLS handshake verified (``use_identity_as_username``)."""
        conn.opened_at = at
        conn.cert_cn = cert_cn
        self.deadlines.refile(conn, next_check(conn, at))

    def receive(self, conn: Connection, data: bytes, now: float) -> list[Action]:
        """Handle bytes read from ``conn``: decode whole packets and act on each, in order; returns the actions.

        A run of more than :data:`~gateway.broker.inflight.ACK_RUN_PART` plain PUBACKs at the start is handled
        in parts: after the first, ``conn``'s action says ``more`` and the rest (with any bytes after the run)
        waits for :meth:`resume`, so that the I/O layer can write the messages the first part let into the window.
        Past ``max_publish_rate`` a PUBLISH waits for its token with the bytes after it: ``conn``'s action says
        ``pause_until``. A publisher while a consumer is congested is paused :data:`UNTIL_RELEASED`."""
        published = self.stats.publish_received
        self._receive(conn, data, now)
        actions = hand_out(self) if self.dirty else NO_ACTIONS
        if conn.pending or conn.deferred is not None or (
            self.congested and self.stats.publish_received != published and conn.state != CLOSED
        ):
            actions = self._reading(conn, actions, published)
        return actions

    def _read_actions(self, conn: Connection, published: int) -> list[Action]:
        """The actions of an input that read from ``conn`` (``published``: the PUBLISH count before it), as
        :meth:`receive` makes them."""
        actions = hand_out(self)
        if conn.pending or conn.deferred is not None or (
            self.congested and self.stats.publish_received != published and conn.state != CLOSED
        ):
            actions = self._reading(conn, actions, published)
        return actions

    def _receive(self, conn: Connection, data: bytes, now: float) -> None:
        if conn.state == CLOSED:
            return
        conn.last_rx = now
        self.input_owns = False
        self.stats.bytes_received += len(data)
        if conn.deferred is not None:  # max_publish_rate: a PUBLISH waits for its token (one comparison a read)
            waiting = self._deferred(conn, data, now)
            if waiting is None:
                return
            data = waiting
        first = data[0] if data else 0
        if first in _ACK_RUNS and conn.state == CONNECTED:
            # A run of plain PUBRECs, PUBRELs or PUBCOMPs (QoS 2 flows), read without a packet object each.
            pids, used = conn.reader.leading_acks(data, first)
            if pids:
                self.stats.received[first >> 4] += len(pids)
                _ACK_RUNS[first](self, conn, pids, now)
                if used == len(data) or conn.state == CLOSED:
                    return
                data = data[used:]
        elif first == 0x40 and conn.state == CONNECTED:
            pids, used = conn.reader.leading_pubacks(data)
            if pids:
                self.stats.received[4] += len(pids)
                if len(pids) > ACK_RUN_PART:
                    conn.pending = True
                    conn.pending_acks = pids[ACK_RUN_PART:]
                    rest = conn.pending_data = data[used:]
                    self.stats.bytes_received -= len(rest)  # counted when resume() hands it back here
                    on_pubacks(self, conn, pids[:ACK_RUN_PART], now)
                    return
                on_pubacks(self, conn, pids, now)
                if used == len(data) or conn.state == CLOSED:
                    return
                data = data[used:]
        packets = conn.reader.feed(data)
        try:
            for packet in packets:
                self.stats.received[packet.TYPE] += 1
                if conn.state == CONNECTED:
                    handler = self._handlers.get(packet.TYPE)
                    if handler is None:
                        if packet.TYPE == 1:
                            raise ProtocolError("a second CONNECT on the same connection [MQTT-3.1.0-2]")
                        raise ProtocolError(f"a client must not send {PACKET_NAMES[packet.TYPE]}")
                    handler(self, conn, packet, now)
                    if conn.deferred is not None:
                        # Past max_publish_rate: this PUBLISH waits for its token; the bytes after it stay in the
                        # reader (PacketReader.feed keeps what it did not yield when closed); the action says
                        # until when the I/O layer stops reading, then pause_over() goes on.
                        packets.close()
                        return
                elif conn.state == AWAITING_CONNECT:
                    if not isinstance(packet, Connect):
                        self.rlog.info(
                            now,
                            peer_host(conn.peer),
                            "not_connect",
                            "%s: first packet is %s, not CONNECT; closing [MQTT-3.1.0-1]",
                            conn.peer,
                            PACKET_NAMES[packet.TYPE],
                        )
                        session_lifecycle.close(self, conn, now, publish_will=False)
                        return
                    if not connect.hold(self, conn, packet, now):
                        connect.on_connect(self, conn, packet, now)
                elif conn.state == HELD:
                    conn.hold_behind(packet)  # handled once the throttled CONNECT is (Connection.take_held)
                else:
                    return
        except UnsupportedProtocolVersion as unsupported:  # its own name: compiled, a variable has one type
            self._unsupported_version(conn, unsupported, now)
        except MQTTError as exc:
            self._protocol_error(conn, exc, now)

    def _deferred(self, conn: Connection, data: bytes, now: float) -> bytes | None:
        """Handle the PUBLISH that waited for a ``max_publish_rate`` token; return the bytes to go on with (those
        that arrived meanwhile and ``data``), or ``None`` when it must wait longer (they are kept) or the
        connection closed."""
        packet, kept = conn.take_deferred()
        waiting = kept + data if kept else data
        if conn.paused_until == UNTIL_RELEASED:  # it waited for room under max_awaiting_rel (3.1.1)
            conn.paused_until = now  # Keep Alive counts again, from the end of the pause
            self.deadlines.refile(conn, next_check(conn, now))
        try:
            inbound.on_publish(self, conn, packet, now)
        except MQTTError as exc:
            self._protocol_error(conn, exc, now)
            return None
        if conn.deferred is not None:  # still no token
            conn.keep_reading_later(waiting)
            return None
        return waiting if conn.state != CLOSED else None

    def _reading(self, conn: Connection, actions: list[Action], published: int) -> list[Action]:
        """``conn``'s action with what the I/O layer must do about reading from it: go on with the rest of the
        bytes first (``more``), wait for a ``max_publish_rate`` token (``pause_until``), or wait while a consumer
        is congested (a publisher that is not itself congested: :data:`UNTIL_RELEASED`)."""
        more = conn.pending and conn.state != CLOSED
        if conn.deferred is not None:
            pause = conn.paused_until
        elif self.congested and self.stats.publish_received != published and conn.session not in self.congested:
            pause = UNTIL_RELEASED
        else:
            pause = 0.0
        if not more and not pause:
            return actions
        for i, action in enumerate(actions):
            if action.conn is conn:
                # The constructor, not NamedTuple._replace: that one runs as interpreted Python, once per part of
                # a run of PUBACKs.
                actions[i] = Action(conn, action.data, action.close, action.reason, pause, more)
                return actions
        return [*actions, Action(conn, [], conn.closing, conn.close_reason, pause, more)]

    def holds_back(self, conn: Connection) -> bool:
        """Whether reading from ``conn``, paused :data:`UNTIL_RELEASED`, must stay paused: a 3.1.1 PUBLISH waits
        for room under ``max_awaiting_rel`` and a commit can still make it
        (:func:`~gateway.broker.inbound.wait_for_acknowledgements`), or some consumer is still congested and
        ``conn`` is not one of them (a congested consumer's acknowledgements must get through). When it says no,
        :meth:`release` goes on."""
        if conn.state == CLOSED:
            return False
        if conn.paused_until == UNTIL_RELEASED:
            session = conn.session
            pending = conn.inbound_pending
            return bool(pending) and session is not None and (
                pending + len(session.awaiting_rel) >= conn.limits.max_awaiting_rel
            )
        congested = self.congested
        return bool(congested) and conn.session not in congested

    def release(self, conn: Connection, now: float) -> list[Action]:
        """Reading from ``conn``, paused :data:`UNTIL_RELEASED`, goes on (:meth:`holds_back` said no): the PUBLISH
        that waited for room under ``max_awaiting_rel``, if any, then the bytes read after it; the actions
        (possibly paused again), as :meth:`receive`."""
        if conn.deferred is None or conn.paused_until != UNTIL_RELEASED:
            return NO_ACTIONS
        return self._take_up_deferred(conn, now)

    def pause_over(self, conn: Connection, now: float) -> list[Action]:
        """The ``max_publish_rate`` pause of ``conn`` passed (its action's ``pause_until``): the PUBLISH that
        waited for its token, then the bytes read after it; the actions (possibly paused again)."""
        return self._take_up_deferred(conn, now)

    def _take_up_deferred(self, conn: Connection, now: float) -> list[Action]:
        """The deferred PUBLISH of ``conn`` (if any) and the bytes kept after it, as a read with no new bytes."""
        published = self.stats.publish_received
        self._receive(conn, b"", now)
        return self._read_actions(conn, published)

    def resume(self, conn: Connection, now: float) -> list[Action]:
        """Go on with what :meth:`receive` left pending on ``conn`` (its action said ``more``): the next part of a
        run of PUBACKs, and after its last part the bytes that followed the run; the actions, as :meth:`receive`."""
        if not conn.pending:
            return NO_ACTIONS
        published = self.stats.publish_received
        self._resume(conn, now)
        return self._read_actions(conn, published)

    def _resume(self, conn: Connection, now: float) -> None:
        self.input_owns = False
        pids = conn.pending_acks
        if conn.state == CLOSED:
            pids = NO_ACKS
        elif len(pids) > ACK_RUN_PART:
            conn.pending_acks = pids[ACK_RUN_PART:]
            on_pubacks(self, conn, pids[:ACK_RUN_PART], now)
            return
        rest = conn.pending_data
        conn.pending = False
        conn.pending_acks = NO_ACKS
        conn.pending_data = b""
        if pids:
            on_pubacks(self, conn, pids, now)
        if rest and conn.state != CLOSED:
            self._receive(conn, rest, now)

    def connection_lost(self, conn: Connection, now: float) -> list[Action]:
        """The Network Connection closed (by the peer, or after the broker asked); the actions (its Will, a
        take-over's consequences, for other connections)."""
        self.connections.pop(conn, None)
        self.deadlines.unschedule(conn)
        self.held.discard(conn)
        conn.pending = False
        if conn.state != CLOSED:
            conn.move_to(CLOSED)
            session_lifecycle.detach(self, conn, now, publish_will=True)
        dirty = self.dirty
        if not dirty:
            return NO_ACTIONS
        dirty.discard(conn)  # nothing more is written to it
        return hand_out(self)

    def pause_writing(self, conn: Connection, now: float) -> None:
        """The connection's socket write buffer passed ``high_watermark``: QoS 0 messages to it are dropped and
        QoS 1/2 wait in its Message Queue (bounded by ``max_mqueue_len`` and ``max_mqueue_bytes``) instead of the
        socket buffer, so a slow subscriber cannot grow the broker's memory without bound; if it stays so for
        ``send_timeout`` seconds the connection is closed (:meth:`tick`)."""
        conn.paused = True
        conn.paused_at = now
        if conn.limits.send_timeout:
            self.deadlines.schedule(conn, now + conn.limits.send_timeout)

    def resume_writing(self, conn: Connection, now: float) -> list[Action]:
        """The socket drained below its low-water mark: send what waited; the actions."""
        conn.paused = False
        session = conn.session
        if session is not None and session.conn is conn:
            inflight.pump(self, session, now)
        return hand_out(self)

    def tick(self, now: float) -> list[Action]:
        """Run every deadline that has passed (:mod:`gateway.broker.timers`) and the ``$SYS`` updates; the
        actions."""
        self.input_owns = False
        timers.run(self, now)
        if self.held:
            self._release_held(now)
        if self.settings.sys_interval and now >= self.next_sys:
            self.next_sys = now + self.settings.sys_interval
            self.publish_sys(now)
        return hand_out(self)

    def _release_held(self, now: float) -> None:
        """Handle the CONNECTs the failure throttle held whose delay is over (:func:`.connect.hold`), then the
        packets that arrived behind them, in order."""
        for conn in [c for c in self.held if now >= c.held_until]:
            self.held.discard(conn)
            packets = conn.take_held()
            if conn.state != HELD:
                continue
            conn.move_to(AWAITING_CONNECT)
            try:
                connect.on_connect(self, conn, packets[0], now)
                for packet in packets[1:]:
                    if conn.state != CONNECTED:
                        break
                    handler = self._handlers.get(packet.TYPE)
                    if handler is None:
                        raise ProtocolError(f"a client must not send {PACKET_NAMES[packet.TYPE]} here")
                    handler(self, conn, packet, now)
            except MQTTError as exc:
                self._protocol_error(conn, exc, now)

    def reload_access(self, rules: dict[str, access_decisions.ListenerAccess], now: float) -> None:
        """New authentication and ACL rules per listener (SIGHUP, after the files parsed): later CONNECTs use
        them, and every session's ACL and subscription decisions are resolved again (:func:`.access_decisions.reload`);
        no connection is closed."""
        access_decisions.reload(self, rules)
        log.info("access rules reloaded for %d listener(s); %d sessions re-checked", len(rules), len(self.sessions))

    def shutdown(self, now: float) -> list[Action]:
        """Server shutting down: DISCONNECT 0x8B to 5.0 clients, close every connection (MQTT 5.0 §3.14); the
        actions."""
        for conn in list(self.connections):
            if conn.state == CONNECTED and conn.version == MQTT_5:
                send(self, conn, Disconnect(RC.SERVER_SHUTTING_DOWN))
            session_lifecycle.close(self, conn, now, publish_will=False, reason="server shutting down")
        return hand_out(self)

    # ------------------------------------------------------------------------------------------ from the store

    def committed(self, barrier: int, now: float) -> list[Action]:
        """The store committed everything recorded before commit barrier ``barrier`` (and so every earlier barrier):
        the acknowledgements held under them are emitted, in order (:mod:`gateway.broker.commits`); the actions."""
        commits.committed(self, barrier, now)
        return hand_out(self)

    def failed(self, barrier: int, full: bool, now: float) -> list[Action]:
        """The commit holding barrier ``barrier`` (and the earlier ones not yet reported) failed; ``full``: for lack
        of room (MQTT 5 publishers get 0x97 Quota exceeded, else 0x80). What owns changes in it is refused, the
        rest acknowledged in order (:mod:`gateway.broker.barriers`); the actions."""
        commits.failed(self, barrier, full, now)
        return hand_out(self)

    def store_change_failed(self, client_ids: set[str], now: float) -> list[Action]:
        """The store left changes of these clients out of a commit because they failed on their own (the rest of
        the batch was committed; ``LmdbStore.on_change_failed``). Their connections are closed before that
        commit's acknowledgements run, so nothing of theirs that was not written is acknowledged:
        MQTT 5 DISCONNECT 0x80 Unspecified error with a Reason String (MQTT 5.0 §3.14.2.1), 3.1.1 just closed."""
        for client_id in client_ids:
            session = self.sessions.get(client_id)
            conn = session.conn if session is not None else None
            if conn is None or conn.state != CONNECTED:
                continue
            log.error(
                "%s (%s): the store could not write a change of this client; closing its connection",
                conn.peer,
                client_id[:200],
            )
            packet = disconnect(conn.version, RC.UNSPECIFIED_ERROR, "the server could not store this client's state")
            if packet is not None:
                send(self, conn, packet)
            session_lifecycle.close(self, conn, now, publish_will=True, reason="a change of its state failed to store")
        return hand_out(self)

    def queue_rows_lost(self, client_id: str, seqs: list[int]) -> None:
        """The store did not write these queue rows of ``client_id`` (:func:`.delivery.queue_rows_lost`)."""
        delivery.queue_rows_lost(self, client_id, seqs)

    # ------------------------------------------------------------------------------------------ errors

    def _protocol_error(self, conn: Connection, exc: MQTTError, now: float) -> None:
        code = exc.reason_code
        self.rlog.warning(
            now,
            peer_host(conn.peer),
            code.name,
            "%s (%s): %s; closing with reason code 0x%02X %s",
            conn.peer,
            conn.client_id or "-",
            exc,
            code,
            code.name,
        )
        self.stats.dropped["protocol_error"] += 1
        if conn.state == CONNECTED:
            packet = disconnect(conn.version, code, str(exc))
            if packet is not None:
                send(self, conn, packet)
        elif conn.state == AWAITING_CONNECT and conn.version == MQTT_5 and conn.reader.version == MQTT_5:
            connack = connack_refusal_packet(conn.version, code, str(exc))
            if connack is not None:
                send(self, conn, connack)
        session_lifecycle.close(self, conn, now, publish_will=True, reason=f"{code.name}: {exc}")

    def _unsupported_version(self, conn: Connection, exc: UnsupportedProtocolVersion, now: float) -> None:
        if conn.state == CONNECTED:
            # A second CONNECT, whatever Protocol Level it names, is a Protocol Error [MQTT-3.1.0-2]: DISCONNECT
            # 0x82 (5.0), not a CONNACK after the CONNACK (found by tests/fuzzing.py).
            self._protocol_error(conn, ProtocolError("a second CONNECT on the same connection [MQTT-3.1.0-2]"), now)
            return
        self.rlog.warning(now, peer_host(conn.peer), "unsupported_version", "%s: %s", conn.peer, exc)
        self.stats.connect_refused["unsupported_protocol_version"] += 1
        answer = unsupported_version_connack(exc.level)
        if answer is not None:
            send_raw(self, conn, answer[1].encode(answer[0]))
        session_lifecycle.close(self, conn, now, publish_will=False, reason="unsupported protocol version")

    # ------------------------------------------------------------------------------------------ messages

    def publish_local(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        properties: Any,
        now: float,
        sender: str | None = None,
        expires_at: float | None = None,
    ) -> list[Action]:
        """Publish a message that did not arrive on a client connection (the upstream bridge's downlink and its
        ``$SYS`` values), routed like any PUBLISH; the actions. ``sender`` names the origin (``$upstream/<name>``
        for the downlink, so the bridge never forwards it back up)."""
        message = Message(self.new_mid(), topic, payload, qos, retain, properties, now, expires_at, sender)
        router.publish(self, message, now)
        return hand_out(self)

    def sys_values(self, now: float) -> dict[str, str]:
        """The ``$SYS/broker/...`` values (Mosquitto's names), as strings."""
        s = self.stats
        values = {
            "version": f"edge-gateway {__version__}",
            "uptime": f"{int(now - self.started_at)} seconds",
            "clients/connected": str(s.clients_connected),
            "clients/total": str(len(self.sessions)),
            "clients/maximum": str(s.clients_maximum),
            "messages/received": str(s.messages_received),
            "messages/sent": str(s.messages_sent),
            "publish/messages/received": str(s.publish_received),
            "publish/messages/sent": str(s.publish_sent),
            "publish/messages/dropped": str(sum(s.dropped.values())),
            "subscriptions/count": str(self.tree.count),
            "retained messages/count": str(len(self.retained)),
            "store/messages/count": str(sum(len(x.mqueue) + len(x.inflight) for x in self.sessions.values())),
        }
        for reason, count in sorted(s.dropped.items()):
            values[f"messages/dropped/{reason}"] = str(count)
        for reason, count in sorted(s.refused.items()):
            values[f"refused/{reason}"] = str(count)
        values["log/suppressed"] = str(self.rlog.suppressed)
        return values

    def publish_sys(self, now: float) -> None:
        """Publish the ``$SYS`` values as retained QoS 0 messages."""
        for name, value in self.sys_values(now).items():
            message = Message(self.new_mid(), f"$SYS/broker/{name}", value.encode(), 0, True, {}, now, None, None)
            router.publish(self, message, now)


# ---------------------------------------------------------------------------------------------- small packets


def _on_pingreq(core: BrokerState, conn: Connection, p: PingReq, now: float) -> None:
    send(core, conn, PingResp())


def _on_auth(core: BrokerState, conn: Connection, p: Auth, now: float) -> None:
    raise ProtocolError("AUTH without an Authentication Method in CONNECT (MQTT 5.0 §4.12)")


def _on_disconnect(core: BrokerState, conn: Connection, p: Disconnect, now: float) -> None:
    session = conn.session
    assert session is not None
    publish_will = False
    if conn.version == MQTT_5:
        expiry = p.properties.get(P.SESSION_EXPIRY_INTERVAL)
        if expiry is not None:
            if session.expiry_interval == 0 and expiry != 0:
                raise ProtocolError("DISCONNECT sets a Session Expiry Interval after CONNECT had 0 [MQTT-3.14.2-2]")
            was = session.persistent
            session.expiry_interval = min(expiry, conn.limits.session_expiry_interval)
            core.persistent_count += session.persistent - was
            if session.persistent:
                core.store.session_saved(session)
            elif was:
                core.store.session_deleted(session.client_id)
        publish_will = p.reason_code == RC.DISCONNECT_WITH_WILL_MESSAGE
    # A normal DISCONNECT discards the Will [MQTT-3.1.2-10] [MQTT-3.14.4-3]: detach takes it and publishes it only
    # with publish_will.
    session_lifecycle.close(core, conn, now, publish_will=publish_will)
