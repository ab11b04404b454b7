"""The upstream outbox as a sans-I/O state machine (docs/upstream.md).

:class:`Outbox` holds what one ``[[upstream]]`` link still has to deliver and decides what to send when: order per
remote topic, the inflight window, the paced drain of a backlog, the live lane, re-sends after a reconnect, the
bounds and their drops, and the counters the link reports on ``$SYS``. It does no I/O and reads no clock: every
event method takes ``now`` (wall-clock seconds, the broker's clock) and the glue in :mod:`gateway.upstream.link`
performs what it returns, like h11 or wsproto.

Events (input), each a method:

- :meth:`Outbox.load`: the rows stored before a restart (once, before any client can publish).
- :meth:`Outbox.offer`: a message the broker routed (``Broker.forwarders``); True when it was taken.
- :meth:`Outbox.link_up` / :meth:`Outbox.link_down`: the connection to the cloud broker came (with the limits of
  its CONNACK) or went.
- :meth:`Outbox.sent` / :meth:`Outbox.send_failed`: the glue handed a :class:`Send` to the connection (with the
  Packet Identifier the client library gave it), or could not.
- :meth:`Outbox.acked`: a PUBACK (QoS 1) or PUBCOMP (QoS 2) with its reason code (a refusal is final or "retry
  later": :mod:`gateway.upstream.verdicts`).
- :meth:`Outbox.tick`: time passed (TTL, Message Expiry, the half-open check).

Outputs:

- :meth:`Outbox.next_send` returns the next :class:`Send` ("send this PUBLISH: topic, payload, QoS, RETAIN,
  properties, and its size in bytes"), or None when nothing may go now; then :attr:`Outbox.wake_at` is when
  pacing or a "retry later" pause allows the next one.
- :meth:`Outbox.tick` returns a :class:`TearDown` when the link looks half-open.
- :meth:`Outbox.warning` returns the text of the drops to announce (at most once a second).
- Store rows: the outbox writes them itself through the broker's store interface (:class:`OutboxStore`, the
  ``outbox_*`` methods of ``gateway.broker.store_port.SessionStore``), which only records changes for the next group
  commit and does no I/O either. It is called directly rather than returned as records because the row must join
  the commit that acknowledges the local publisher, inside ``router.publish``, and a ``msg_id`` needs its store
  sequence at once; a record per message for the glue to replay would only add cost to the forward path.
- Drops are counted by reason in :attr:`Outbox.dropped` (and queued for :meth:`Outbox.warning`).

Time: ``now`` is wall-clock seconds (``Message.received_at`` and ``expires_at`` are too). Pacing and the
``ack_timeout`` check need elapsed time, which the outbox derives from the ``now`` values it is given, counting a
backward step of the wall clock as no time passing (a forward step, e.g. NTP setting the clock at boot, counts
as elapsed: at worst one needless reconnect and one second's burst of backlog).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from typing import TYPE_CHECKING

from gateway.broker.store_port import OutboxRecord
from gateway.mqtt.topics import topic_matches
from gateway.upstream.config import literal_prefix
from gateway.upstream.entries import (
    BACKLOG,
    DONE,
    INFLIGHT,
    LIVE,
    QUEUED,
    SENDING,
    Entry,
    OutboxStore,
    PeerLimits,
    Send,
    TearDown,
    publish_of,
)
from gateway.upstream.verdicts import RETRY_LATER, PoisonGuard

if TYPE_CHECKING:
    from gateway.broker.message import Message
    from gateway.upstream.config import UpstreamConfig

log = logging.getLogger("gateway.upstream")

#: Message.sender of everything the downlink publishes locally: never forwarded back up (loops).
SENDER_PREFIX = "$upstream/"

class Outbox:
    """One link's outbox (see the module docstring for the events and outputs).

    Args:
        cfg: the link's configuration (forward rules, order, drain_rate / drain_bytes, max_inflight, bounds,
            message_ttl, ack_timeout, store_qos0, protocol, gateway_id, name, max_packet_size, max_retries,
            poison_closes / poison_window, backoff_initial / backoff_max for "retry later" pauses).
        store: the broker's store (only its ``outbox_*`` methods are used).

    Attributes:
        entries: every entry by key, in arrival order (the head is the oldest).
        bytes: payload + remote topic bytes of ``entries``.
        inflight: entries awaiting PUBACK/PUBCOMP, by Packet Identifier.
        up: the link is connected (between :meth:`link_up` and :meth:`link_down`).
        window: QoS 1/2 messages allowed in flight: ``max_inflight``, lowered to the cloud's Receive Maximum (and
            to 1 while :attr:`poison` has suspects).
        max_packet: the Maximum Packet Size in force (bytes, 0 = none): the link's ``max_packet_size`` or the
            cloud's announced one, the smaller.
        poison: the :class:`~gateway.upstream.verdicts.PoisonGuard`.
        counters: ``forwarded`` (QoS 1/2 acknowledged, or sent at QoS 0 when the cloud's Maximum QoS is 0),
            ``forwarded_qos0``, ``publish_sent`` (re-sends included), ``connects``, ``ack_timeouts``,
            ``retries`` ("retry later" refusals, each followed by a pause).
        dropped: drops by reason (docs/upstream.md "Bounds and drops").
        last_ack_at: wall-clock seconds of the last PUBACK/PUBCOMP, or None.
        rtt_last, rtt_sum, rtt_count: the last round trip (send to PUBACK/PUBCOMP, seconds, None before the
            first), the sum of all (seconds) and their number.
        wake_at: after :meth:`next_send` returned None because of pacing or a "retry later" pause, the wall-clock
            time at which the next message may go; else None.
        warn_due: drops wait for :meth:`warning`.
    """

    def __init__(self, cfg: UpstreamConfig, store: OutboxStore) -> None:
        self.name = cfg.name
        self.store = store
        self.gateway_id = cfg.gateway_id
        # (literal prefix, rule): a topic that does not start with the filter's levels before its first wildcard
        # cannot match it, which a str.startswith tells faster than topic_matches (most topics match no rule)
        self.rules = [(literal_prefix(rule.local), rule) for rule in cfg.forward]
        self.store_qos0 = cfg.store_qos0
        self.live_first = cfg.order == "live_first"
        self.drain_rate = cfg.drain_rate  # messages per second, 0 = unpaced
        self.drain_bytes = cfg.drain_bytes  # bytes per second, 0 = unpaced
        self.max_inflight = cfg.max_inflight
        self.max_messages = cfg.max_messages
        self.max_bytes = cfg.max_bytes
        self.message_ttl = cfg.message_ttl  # seconds, 0 = never
        self.ack_timeout = cfg.ack_timeout  # seconds
        self.with_msg_id = self.v5 = cfg.protocol == 5
        self.max_packet_size = cfg.max_packet_size  # bytes, 0 = only what the cloud announces
        self.max_retries = cfg.max_retries
        self.backoff_initial = cfg.backoff_initial
        self.backoff_max = cfg.backoff_max
        self.poison = PoisonGuard(cfg.poison_closes, cfg.poison_window)
        self.entries: dict[int, Entry] = {}
        self.backlog: deque[Entry] = deque()
        self.live: deque[Entry] = deque()
        self.qos0: deque[Entry] = deque()  # every QoS 0 entry, oldest first (cleaned lazily)
        self.backlog_topics: Counter[str] = Counter()  # queued backlog entries per remote topic
        self.inflight: dict[int, Entry] = {}
        self.bytes = 0
        self.up = False
        self.window = cfg.max_inflight
        self.max_qos = 2
        self.retain_available = True
        self.max_packet = cfg.max_packet_size
        self.counters: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.last_ack_at: float | None = None
        #: Round trips (seconds from the last send of a QoS 1/2 message to its PUBACK/PUBCOMP): the last one,
        #: their sum and their number.
        self.rtt_last: float | None = None
        self.rtt_sum = 0.0
        self.rtt_count = 0
        self.wake_at: float | None = None
        self.warn_due = False
        self._warn_pending: Counter[str] = Counter()
        self._warn_next = 0.0
        self._local_key = 0
        self._wall: float | None = None  # the last ``now`` seen
        self._elapsed = 0.0  # monotonic seconds derived from the ``now`` values
        self._last_ack_elapsed = 0.0
        self._tokens = (0.0, 0.0)  # drain tokens: messages, bytes
        self._tokens_at = 0.0
        self._timed_out = False
        self._paused_until = 0.0  # elapsed seconds: a "retry later" refusal holds every send until then
        self._pause = 0.0  # the last pause's length (seconds): doubles per refusal, back to 0 on a success

    # ------------------------------------------------------------------------------------------ time

    def _advance(self, now: float) -> float:
        """Elapsed seconds up to ``now``: wall-clock steps backwards count as no time passing."""
        wall = self._wall
        if wall is not None and now > wall:
            self._elapsed += now - wall
        self._wall = now
        return self._elapsed

    # ------------------------------------------------------------------------------------------ events

    def load(self, now: float) -> None:
        """Take the rows stored for this link (before a restart), oldest first, into the backlog; apply TTL and
        bounds (drops counted)."""
        self._advance(now)
        for record in self.store.outbox_loaded(self.name):
            entry = Entry(record.seq, record.seq, record.message, record.qos, record.topic, True)
            self.entries[entry.key] = entry
            self.bytes += entry.size
            if entry.qos == 0:
                self.qos0.append(entry)
            self._to_backlog(entry)
        self._expire(now)
        self._enforce_bounds()

    def offer(self, message: Message, now: float) -> bool:
        """A message the broker routed (the ``Broker.forwarders`` hook, inside ``router.publish``, before the
        local publisher's PUBACK/PUBCOMP is registered, so a stored row is committed with it; docs/upstream.md).

        The first forward rule whose local filter matches decides the remote topic and the QoS
        (min(published, rule)). Returns True when the message was taken (an MQTT 5 publisher is then not told
        "no matching subscribers"); False when no rule matches, the message came down from a cloud (loops), has
        expired, is QoS 0 while the link is down (dropped as ``qos0_link_down`` unless ``store_qos0``), or was
        dropped by a bound.
        """
        sender = message.sender
        if sender is not None and sender.startswith(SENDER_PREFIX):
            return False  # came down from a cloud: never back up
        topic = message.topic
        for prefix, rule in self.rules:
            if topic.startswith(prefix) and topic_matches(rule.local, topic):
                break
        else:
            return False
        qos = min(message.qos, rule.qos)
        if message.expired(now):
            return False
        remote = rule.remote_topic(topic, self.gateway_id)
        durable = qos > 0 or self.store_qos0
        up = self.up
        if not durable and not up:
            self._count_drop("qos0_link_down", 1)
            return False
        size = len(message.payload) + len(remote.encode("utf-8"))
        if (self.max_messages or self.max_bytes) and not self._make_room(size, qos):
            return False
        if durable:
            seq = self.store.outbox_seq()
            self.store.outbox_saved(self.name, OutboxRecord(seq, message, qos, remote))
            entry = Entry(seq, seq, message, qos, remote, True)
        else:
            self._local_key -= 1
            entry = Entry(self._local_key, 0, message, qos, remote, False)
        self.entries[entry.key] = entry
        self.bytes += entry.size
        if qos == 0:
            self.qos0.append(entry)
        if up and (self.live_first or not self.backlog_topics[remote]):
            entry.where = LIVE  # the live lane: not paced
            self.live.append(entry)
        else:
            self._to_backlog(entry, paced=not up)
        return True

    def link_up(self, limits: PeerLimits, now: float) -> None:
        """The connection is up (a new session: Clean Start): size the window (``max_inflight``, lowered to the
        Receive Maximum [MQTT-3.3.4-7]), fill the drain bucket (one second's worth), start the ack clock."""
        elapsed = self._advance(now)
        self.window = self.max_inflight
        if limits.receive_maximum:
            self.window = min(self.window, limits.receive_maximum)
        self.max_qos = limits.maximum_qos
        self.retain_available = limits.retain_available
        announced, own = limits.maximum_packet_size, self.max_packet_size
        self.max_packet = min(announced, own) if announced and own else announced or own
        self.up = True
        self._timed_out = False
        self._last_ack_elapsed = elapsed
        self._tokens = (max(self.drain_rate, 1.0), float(self.drain_bytes))
        self._tokens_at = elapsed
        self.counters["connects"] += 1

    def link_down(self, now: float, by_message: bool = False) -> None:
        """The connection is gone: everything unacknowledged goes back to the backlog in arrival order (sent again,
        paced, after the reconnect, with the same ``msg_id``); QoS 0 kept in memory only is dropped
        (``qos0_link_down``).

        ``by_message``: the cloud closed the connection without a reason that clears the messages in flight
        (:data:`~gateway.upstream.verdicts.NOT_A_MESSAGE`); the :class:`~gateway.upstream.verdicts.PoisonGuard`
        weighs the close, and a message it names is dropped as ``poison`` (logged with its topic and size).
        """
        elapsed = self._advance(now)
        poison = None
        if self.up:  # the glue may report one loss twice (a failed send, then the connection's end)
            unacked = [(e.key, e.sent_at) for e in self.inflight.values() if e.state == INFLIGHT]
            poison = self.poison.closed(unacked, elapsed, by_message)
        if poison is not None:
            entry = self.entries[poison]
            log.warning(
                "upstream %s: the cloud broker closed the connection right after %s (%d bytes, msg_id %s) "
                "was sent alone, %d times in a row; setting it aside (dropped as poison)",
                self.name,
                entry.topic,
                len(entry.message.payload),
                f"{self.gateway_id}:{entry.seq}" if entry.seq else "none",
                self.poison.closes,
            )
            self._drop(entry, "poison")
        self.up = False
        self.wake_at = None
        self.inflight.clear()
        self.backlog.clear()
        self.live.clear()
        self.backlog_topics.clear()
        lost_qos0 = 0
        for entry in list(self.entries.values()):
            entry.state = QUEUED
            entry.where = 0
            if entry.durable:
                self._to_backlog(entry)
            else:
                self._remove(entry)
                lost_qos0 += 1
        self.qos0 = deque(e for e in self.entries.values() if e.qos == 0)
        if lost_qos0:
            self._count_drop("qos0_link_down", lost_qos0)

    def next_send(self, now: float) -> Send | None:
        """The next message to send now, or None: the link is down, nothing waits, the window is full
        (QoS 1/2; [MQTT-4.9.0-2]; one at a time while :attr:`poison` has suspects), the drain is paced or paused
        after a "retry later" refusal (then :attr:`wake_at` says until when).

        ``order = "backlog_first"`` takes the backlog's head first, ``live_first`` the live lane's; a live entry
        for a topic that had backlog when it arrived waits in the backlog behind it (order per topic). Entries
        past ``message_ttl`` or their Message Expiry are dropped on the way, and so is a PUBLISH whose encoded size
        (:attr:`Send.size`) is over :attr:`max_packet` (``packet_too_large``). Each Send must be answered by
        :meth:`sent` or :meth:`send_failed` before the next call.
        """
        self.wake_at = None
        if not self.up:
            return None
        if self._paused_until:
            wait = self._paused_until - self._advance(now)
            if wait > 0:
                self.wake_at = now + wait
                return None
            self._paused_until = 0.0
        first, second = (self.live, self.backlog) if self.live_first else (self.backlog, self.live)
        while True:
            entry = self._take(first, now) or self._take(second, now)
            if entry is None:
                return None
            send = publish_of(entry, now, self.v5, self.gateway_id, self.max_qos, self.retain_available)
            if self.max_packet and send.size > self.max_packet:
                log.warning(
                    "upstream %s: %s is %d bytes as a PUBLISH, over the Maximum Packet Size of %d; dropped",
                    self.name,
                    entry.topic,
                    send.size,
                    self.max_packet,
                )
                self._drop(entry, "packet_too_large")
                continue
            entry.state = SENDING
            return send

    def sent(self, send: Send, packet_id: int, now: float) -> None:
        """The connection took ``send`` (``packet_id``: the Packet Identifier it was given; ignored at QoS 0). A
        QoS 0 send leaves the outbox now; QoS 1/2 waits in flight for :meth:`acked`."""
        entry = send.entry
        self.counters["publish_sent"] += 1
        if send.qos == 0:
            self.counters["forwarded_qos0" if entry.qos == 0 else "forwarded"] += 1
            self._remove(entry)
            return
        entry.state = INFLIGHT
        entry.sent_at = self._advance(now)
        entry.packet_id = packet_id
        self.inflight[packet_id] = entry

    def send_failed(self, send: Send, now: float) -> None:
        """The connection refused ``send`` (its socket is gone): the link counts as down from here on (same as
        :meth:`link_down`, a close by the cloud; the glue tears the connection down)."""
        send.entry.state = QUEUED
        self.link_down(now, by_message=True)

    def acked(self, packet_id: int, reason_code: int, now: float) -> bool:
        """A PUBACK (QoS 1) or PUBCOMP (QoS 2) for ``packet_id`` with ``reason_code`` (MQTT 5.0 §3.4.2.1).

        Success (< 0x80) removes the entry (``forwarded``). A "retry later" code
        (:data:`~gateway.upstream.verdicts.RETRY_LATER`: 0x97 Quota exceeded, 0x80 Unspecified error) puts it back
        at the head of the backlog and pauses every send for a backoff (``backoff_initial``, doubling up to
        ``backoff_max``, back to the start after a success); 0x80 at most ``max_retries`` times, then it is
        ``rejected``. Any other failure code drops it as ``rejected`` (final: the cloud said no, e.g. 0x87 Not
        authorized). Returns False for a Packet Identifier not in flight (nothing changed)."""
        entry = self.inflight.pop(packet_id, None)
        if entry is None or entry.state != INFLIGHT:
            return False
        self.last_ack_at = now
        elapsed = self._last_ack_elapsed = self._advance(now)
        rtt = self.rtt_last = max(0.0, elapsed - entry.sent_at)
        self.rtt_sum += rtt
        self.rtt_count += 1
        if reason_code in RETRY_LATER and not (RETRY_LATER[reason_code] and entry.retries >= self.max_retries):
            self._retry_later(entry, reason_code, elapsed)
        elif reason_code >= 0x80:
            log.warning(
                "upstream %s: %s refused by the cloud broker (reason 0x%02X); dropped",
                self.name,
                entry.topic,
                reason_code,
            )
            self._drop(entry, "rejected")
        else:
            self.counters["forwarded"] += 1
            self._pause = 0.0
            self._remove(entry)
        return True

    def _retry_later(self, entry: Entry, reason_code: int, elapsed: float) -> None:
        """``entry`` was refused for now: back into the backlog in arrival order, and every send paused."""
        entry.retries += 1
        self.counters["retries"] += 1
        pause = self._pause = min(self.backoff_max, self._pause * 2 if self._pause else self.backoff_initial)
        self._paused_until = max(self._paused_until, elapsed + pause)
        log.warning(
            "upstream %s: %s refused for now by the cloud broker (reason 0x%02X, %d time%s); pausing the outbox "
            "for %.1f s",
            self.name,
            entry.topic,
            reason_code,
            entry.retries,
            "" if entry.retries == 1 else "s",
            pause,
        )
        entry.state = QUEUED
        entry.where = BACKLOG
        entry.paced = False
        backlog = self.backlog  # arrival order: before the first younger entry still waiting
        at = next((i for i, e in enumerate(backlog) if e.key > entry.key and e.state == QUEUED), len(backlog))
        backlog.insert(at, entry)
        self.backlog_topics[entry.topic] += 1

    def tick(self, now: float) -> TearDown | None:
        """Time passed: drop what outlived ``message_ttl`` or its Message Expiry; return a :class:`TearDown` once
        when QoS 1/2 messages have been in flight for ``ack_timeout`` seconds without any acknowledgement while
        connected (a half-open link: keep alive does not catch a peer that answers PINGREQ only)."""
        elapsed = self._advance(now)
        self._expire(now)
        if self.up and self.inflight and not self._timed_out:
            oldest = min(e.sent_at for e in self.inflight.values())
            silent_for = elapsed - max(oldest, self._last_ack_elapsed)
            if silent_for >= self.ack_timeout:
                self._timed_out = True
                self.counters["ack_timeouts"] += 1
                return TearDown("ack_timeout", silent_for, len(self.inflight))
        return None

    def warning(self, now: float) -> str | None:
        """What the bounds dropped since the last warning (``"2 max_messages, 1 message_ttl"``), at most once a
        second; None when there is nothing to say yet. QoS 0 dropped while down is not warned about (it is the
        configured behaviour, counted only)."""
        if not self._warn_pending or now < self._warn_next:
            return None
        self._warn_next = now + 1.0
        text = ", ".join(f"{n} {reason}" for reason, n in sorted(self._warn_pending.items()))
        self._warn_pending.clear()
        self.warn_due = False
        return text

    # ------------------------------------------------------------------------------------------ lanes

    def _to_backlog(self, entry: Entry, paced: bool = True) -> None:
        entry.where = BACKLOG
        entry.paced = paced
        self.backlog.append(entry)
        self.backlog_topics[entry.topic] += 1

    def _backlog_left(self, entry: Entry) -> None:
        n = self.backlog_topics[entry.topic] - 1
        if n > 0:
            self.backlog_topics[entry.topic] = n
        else:
            del self.backlog_topics[entry.topic]

    def _take(self, queue: deque[Entry], now: float) -> Entry | None:
        """The head of ``queue`` if it may go now (window, drain tokens); stale heads are skipped, expired ones
        dropped."""
        while queue:
            entry = queue[0]
            if entry.state != QUEUED:
                queue.popleft()
                continue
            reason = self._ttl_expired(entry, now)
            if reason is not None:
                queue.popleft()
                self._drop(entry, reason)
                continue
            if entry.qos and len(self.inflight) >= (1 if self.poison.suspects else self.window):
                return None
            if entry.paced and not self._take_tokens(entry.size, now):
                return None
            queue.popleft()
            if entry.where == BACKLOG:
                self._backlog_left(entry)
            entry.where = 0
            return entry
        return None

    def _take_tokens(self, size: int, now: float) -> bool:
        """Token bucket for the drain: ``drain_rate`` messages and ``drain_bytes`` bytes per second, one second's
        worth of burst (a message larger than that may still go alone). False sets :attr:`wake_at`."""
        rate, brate = self.drain_rate, self.drain_bytes
        if not rate and not brate:
            return True
        elapsed_now = self._advance(now)
        elapsed = elapsed_now - self._tokens_at
        self._tokens_at = elapsed_now
        msgs, nbytes = self._tokens
        cap_b = max(brate, size)
        msgs = min(max(rate, 1.0), msgs + elapsed * rate) if rate else 1.0
        nbytes = min(cap_b, nbytes + elapsed * brate) if brate else float(size)
        if msgs >= 1.0 and nbytes >= size:
            self._tokens = (msgs - 1.0 if rate else 0.0, nbytes - size if brate else 0.0)
            return True
        self._tokens = (msgs, nbytes)
        wait = max((1.0 - msgs) / rate if rate else 0.0, (size - nbytes) / brate if brate else 0.0)
        self.wake_at = now + max(wait, 0.001)
        return False

    # ------------------------------------------------------------------------------------------ removal, bounds

    def _remove(self, entry: Entry) -> None:
        """``entry`` leaves the outbox (acknowledged, sent at QoS 0, or dropped); its row is deleted."""
        if entry.state == QUEUED and entry.where == BACKLOG:
            self._backlog_left(entry)
        entry.state = DONE
        self.poison.left(entry.key)
        if self.entries.pop(entry.key, None) is not None:
            self.bytes -= entry.size
            if entry.durable:
                self.store.outbox_deleted(self.name, entry.seq)

    def _drop(self, entry: Entry, reason: str) -> None:
        self._remove(entry)
        self._count_drop(reason, 1)

    def _count_drop(self, reason: str, n: int) -> None:
        self.dropped[reason] += n
        if reason != "qos0_link_down":  # QoS 0 while down is the configured behaviour, not a bound
            self._warn_pending[reason] += n
            self.warn_due = True

    def _make_room(self, size: int, qos: int) -> bool:
        """Apply ``max_messages`` / ``max_bytes`` before a new entry of ``size`` bytes joins: drop QoS 0 first,
        then the oldest (never one in flight). False when the new entry itself is the one to drop."""
        max_messages, max_bytes = self.max_messages, self.max_bytes
        if max_bytes and size > max_bytes:
            self._count_drop("max_bytes", 1)
            return False
        while True:
            if max_messages and len(self.entries) + 1 > max_messages:
                reason = "max_messages"
            elif max_bytes and self.bytes + size > max_bytes:
                reason = "max_bytes"
            else:
                return True
            victim = self._oldest_qos0()
            if victim is None and qos == 0:
                self._count_drop(reason, 1)  # the new QoS 0 message goes first
                return False
            if victim is None:
                victim = self._oldest_queued()
            if victim is None:
                self._count_drop(reason, 1)
                return False
            self._drop(victim, reason)

    def _enforce_bounds(self) -> None:
        """After :meth:`load` (the bounds may have been lowered since the rows were written)."""
        max_messages, max_bytes = self.max_messages, self.max_bytes
        while (max_messages and len(self.entries) > max_messages) or (max_bytes and self.bytes > max_bytes):
            reason = "max_messages" if max_messages and len(self.entries) > max_messages else "max_bytes"
            victim = self._oldest_qos0() or self._oldest_queued()
            if victim is None:
                return
            self._drop(victim, reason)

    def _oldest_qos0(self) -> Entry | None:
        q = self.qos0
        while q:
            if q[0].state == QUEUED:
                return q[0]
            q.popleft()
        return None

    def _oldest_queued(self) -> Entry | None:
        for entry in self.entries.values():
            if entry.state == QUEUED:
                return entry
        return None

    def _ttl_expired(self, entry: Entry, now: float) -> str | None:
        ttl = self.message_ttl
        if ttl and now - entry.message.received_at >= ttl:
            return "message_ttl"
        if entry.message.expired(now):
            return "expired"
        return None

    def _expire(self, now: float) -> None:
        """Drop queued entries older than ``message_ttl`` (or past their own Message Expiry), oldest first."""
        ttl = self.message_ttl
        victims = []
        for entry in self.entries.values():
            if entry.state != QUEUED:
                continue
            reason = self._ttl_expired(entry, now)
            if reason is not None:
                victims.append((entry, reason))
            elif ttl and now - entry.message.received_at < ttl and entry.message.expires_at is None:
                break  # arrival order: the rest is younger
        for entry, reason in victims:
            self._drop(entry, reason)
