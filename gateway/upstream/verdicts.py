"""What the cloud broker's answers mean for a message on its way up (sans-I/O, like :mod:`gateway.upstream.outbox`).

Two questions the outbox asks the cloud's side of the conversation, answered here in one place each
(docs/upstream.md "When the cloud says no"):

- A PUBACK or PUBCOMP with a Reason Code of 0x80 or more: is that refusal final, or "not now"?
  :data:`RETRY_LATER` lists the codes that mean "not now" (MQTT 5.0 §3.4.2.1): the message goes back to the head
  of the outbox and the whole drain pauses for a backoff. Every other failure code is final: the message is dropped
  as ``rejected``.
- The cloud closed the connection while messages were in flight: did one of them cause it? :class:`PoisonGuard`
  watches for a message the cloud closes the link on every time it is sent ("poison") and names it, so the outbox
  sets it aside and the rest flows, instead of reconnecting and sending it first again forever.
"""

from __future__ import annotations

from gateway.mqtt.reason_codes import ReasonCode as RC

#: PUBACK/PUBCOMP Reason Codes that mean "not now": the cloud is throttling (0x97 Quota exceeded, retried for as long
#: as it answers so; ``message_ttl`` bounds the wait) or had a transient fault (0x80 Unspecified error, retried at
#: most ``max_retries`` times). Value: True when the number of retries is bounded.
RETRY_LATER: dict[int, bool] = {RC.QUOTA_EXCEEDED: False, RC.UNSPECIFIED_ERROR: True}

#: DISCONNECT Reason Codes from the cloud that say why it closed without blaming the packet it last read
#: (MQTT 5.0 §3.14.2.1): its own state, our session or the connection, not a message. Any other code, and a close
#: without DISCONNECT (MQTT 3.1.1, or a reset), may be a message's fault.
NOT_A_MESSAGE: frozenset[int] = frozenset(
    {
        RC.NORMAL_DISCONNECTION,
        RC.SERVER_BUSY,
        RC.SERVER_SHUTTING_DOWN,
        RC.KEEP_ALIVE_TIMEOUT,
        RC.SESSION_TAKEN_OVER,
        RC.ADMINISTRATIVE_ACTION,
        RC.USE_ANOTHER_SERVER,
        RC.SERVER_MOVED,
        RC.CONNECTION_RATE_EXCEEDED,
        RC.MAXIMUM_CONNECT_TIME,
    }
)


class PoisonGuard:
    """Finds a message the cloud closes the connection on each time it is sent.

    A close can only be pinned on one message when that message was the only one in flight, so after a suspicious
    close (the cloud closed within ``window`` seconds of a send, with QoS 1/2 messages unacknowledged) the messages
    that were in flight become *suspects* and the outbox sends one at a time (:attr:`careful`) until each suspect
    is acknowledged or set aside. A message that was alone in flight when the cloud closed right after it was sent,
    ``closes`` times in a row, is named by :meth:`closed` for the outbox to set aside (dropped as ``poison``).

    Inputs: :meth:`closed` (the link went down), :meth:`left` (a message left the outbox). Output: the key returned
    by :meth:`closed`, and :attr:`careful`. Keys are the outbox's entry keys; times are the outbox's elapsed seconds.

    Args:
        closes: consecutive closes that name a message (``poison_closes``); 0 turns the guard off.
        window: seconds from a send within which the cloud's close counts as caused by it (``poison_window``).
    """

    __slots__ = ("closes", "strikes", "suspect", "suspects", "window")

    def __init__(self, closes: int, window: float) -> None:
        self.closes = closes
        self.window = window
        self.suspects: set[int] = set()
        self.suspect: int | None = None  # the message the last close was pinned on
        self.strikes = 0  # consecutive closes pinned on it

    @property
    def careful(self) -> bool:
        """True while suspects are waiting: send one QoS 1/2 message at a time."""
        return bool(self.suspects)

    def closed(self, unacked: list[tuple[int, float]], elapsed: float, by_message: bool) -> int | None:
        """The connection closed.

        Args:
            unacked: ``(key, sent_at)`` of the QoS 1/2 messages sent on this connection and not acknowledged.
            elapsed: the outbox's elapsed seconds now.
            by_message: the cloud closed it, and not for a reason that clears the messages (:data:`NOT_A_MESSAGE`);
                False when the gateway closed it (stopping, ``ack_timeout``).

        Returns:
            The key of the message to set aside, or None.
        """
        if not self.closes:
            return None
        if not by_message or not any(elapsed - sent_at <= self.window for _, sent_at in unacked):
            self.suspect, self.strikes = None, 0  # "in a row" is broken
            return None
        if len(unacked) == 1:
            key = unacked[0][0]
            if key == self.suspect:
                self.strikes += 1
            else:
                self.suspect, self.strikes = key, 1
            if self.strikes >= self.closes:
                self.suspect, self.strikes = None, 0
                self.suspects.discard(key)
                return key
        else:
            self.suspect, self.strikes = None, 0
        self.suspects.update(key for key, _ in unacked)
        return None

    def left(self, key: int) -> None:
        """Entry ``key`` left the outbox (acknowledged or dropped): no longer a suspect."""
        if self.suspects:
            self.suspects.discard(key)
        if key == self.suspect:
            self.suspect, self.strikes = None, 0
