"""What the I/O layer must do after an input of the core: one :class:`Action` per connection concerned.

Every input of :class:`~gateway.broker.broker.Broker` (``receive``, ``resume``, ``pause_over``, ``tick``,
``committed``, ``failed``, ``connection_lost``, ``resume_writing``, ``publish_local``, ``shutdown``, ...) returns a
list of actions, as h11 and wsproto return events: the bytes to write, whether to close (after the bytes, or at
once) and why, and whether to stop reading and until when. The I/O layer performs them and never writes the
core's state; the core never holds a transport.
"""

from __future__ import annotations

from typing import Final, NamedTuple

# Imported at run time, not only for the type checker: compiled by mypyc, the NamedTuple below is made when this
# module is imported, from its fields' classes, so Connection's class must exist by then.
from gateway.broker.session_state import Connection

__all__ = ["ABORT", "CLOSE", "KEEP_OPEN", "NO_ACTIONS", "UNTIL_RELEASED", "Action"]

#: :attr:`Action.close`: keep the connection open; close it once ``data`` is written (a FIN, then a short linger so
#: the client reads the last packet); abort it at once (nothing more can be written: ``send_timeout``).
KEEP_OPEN: Final = 0
CLOSE: Final = 1
ABORT: Final = 2

#: :attr:`Action.pause_until` of a publisher held back while a consumer is congested: until the core no longer
#: holds it back (``Broker.holds_back``), not until a time.
UNTIL_RELEASED: Final = float("inf")


class Action(NamedTuple):
    """What to do with one connection after an input.

    Attributes:
        conn: the connection.
        data: encoded packets to write, in order (possibly empty); the list is the I/O layer's now.
        close: :data:`KEEP_OPEN`, :data:`CLOSE` or :data:`ABORT`.
        reason: why it is closed (for the log), or ``""``.
        pause_until: stop reading from it until this wall-clock time, then call ``Broker.pause_over``
            (``max_publish_rate``); :data:`UNTIL_RELEASED` (flow control: a consumer is congested); 0.0: go on.
        more: part of the bytes read waits (a long run of PUBACKs is handled in parts): write ``data`` now, then
            call ``Broker.resume``.
    """

    conn: Connection
    data: list[bytes]
    close: int = KEEP_OPEN
    reason: str = ""
    pause_until: float = 0.0
    more: bool = False


#: The answer of an input that leaves nothing to do (shared: never changed).
NO_ACTIONS: Final[list[Action]] = []
