"""Authentication and topic ACLs in the core, sans-I/O: the rules arrive as objects, never as files.

The server layer reads each listener's ``password_file`` and ``acl_file`` (:mod:`gateway.auth`) and hands the parsed
objects in through :attr:`BrokerSettings.access <gateway.broker.limits.BrokerSettings.access>` (one
:class:`ListenerAccess` per listener name) and :meth:`Broker.reload_access` (SIGHUP). The core only calls the small
interfaces below, so it imports nothing of ``gateway.auth`` (the layers of docs/architecture.md).

CONNECT (:func:`authenticate`, MQTT 5.0 §3.1.4, §3.2.2.2; MQTT 3.1.1 §3.2.2.3):

- with a ``password_file``, a client that sends a User Name must send its Password and both must verify, else
  CONNACK 0x86 Bad User Name or Password (3.1.1: return code 4); a zero-length Password counts as none, as in
  Mosquitto, so an entry whose hash is that of the empty password lets nobody in (``check-config`` warns of it);
- with ``use_identity_as_username`` (TLS) and no ``password_file``, the verified certificate's CN is the user name
  (mosquitto.conf(5)); a client without one is anonymous;
- a client with no verified user name is anonymous: refused with 0x87 Not authorized (3.1.1: 5) unless
  ``allow_anonymous``. Without a ``password_file`` a User Name the client sends is not verified, so it grants
  nothing: the client counts as anonymous (Mosquitto would apply that name's ACL rules unverified).

Refusals close the connection [MQTT-3.1.4-2] [MQTT-3.2.2-7]. Failed attempts from one address are slowed by the
I/O layer's throttle (:class:`Throttle`, ``gateway.auth.throttle.FailureThrottle``): once an address is throttled
its CONNECT is held (:data:`~gateway.broker.connection_states.HELD`) for the delay before it is checked, whatever its
password, so a client cannot learn the answer sooner by timing it.

ACLs (``acl_file``; :class:`ClientRules` is ``gateway.auth.acl.ClientAcl``): resolved once per connection into
``Session.acl``. PUBLISH checks write; the Will Topic is checked at CONNECT (refused with 0x87 / 3.1.1 return code
5); each subscription is decided once (:func:`decide`): NONE refuses it (SUBACK 0x87 / 3.1.1 0x80), ALL needs no
check per message, PARTIAL puts its key in ``Session.partial`` and the router asks :func:`may_read` per message
only for those. Without any ``acl_file`` ``BrokerState.read_checks`` is False and routing checks nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from gateway.broker.session_state import NO_KEYS, partial_for_write
from gateway.mqtt.reason_codes import ReasonCode as RC

if TYPE_CHECKING:
    from gateway.broker.session_state import Session
    from gateway.broker.state import BrokerState


class PasswordCheck(Protocol):
    """A password file (``gateway.auth.passwd.PasswordFile``)."""

    def verify(self, username: str | None, password: str | bytes | None) -> bool:
        """Whether ``username`` exists and ``password`` is its password (constant time for unknown users)."""
        ...


class ClientRules(Protocol):
    """The ACL rules of one client (``gateway.auth.acl.ClientAcl``)."""

    def may_publish(self, topic: str) -> bool:
        """Whether the client may publish to ``topic`` (``write``)."""
        ...

    def may_receive(self, topic: str) -> bool:
        """Whether a message on ``topic`` may be delivered to the client (``read``)."""
        ...

    def subscribe(self, topic_filter: str) -> Any:
        """``Readable.NONE``, ``PARTIAL`` or ``ALL`` (an enum whose ``value`` is ``"none"``, ...)."""
        ...


class AclRules(Protocol):
    """A parsed ACL file (``gateway.auth.acl.Acl``)."""

    def for_client(self, username: str | None, client_id: str) -> ClientRules:
        """The rules of the client ``client_id`` with ``username`` (``None``: anonymous)."""
        ...


class Throttle(Protocol):
    """Back-off after failed CONNECTs per address (``gateway.auth.throttle.FailureThrottle``); seconds."""

    def delay(self, address: str, now: float) -> float:
        """Seconds to hold a CONNECT from ``address``."""
        ...

    def failure(self, address: str, now: float) -> float:
        """Count a refused CONNECT from ``address``."""
        ...

    def success(self, address: str) -> None:
        """Forget the failures of ``address``."""
        ...


@dataclass(slots=True)
class ListenerAccess:
    """Who may connect to one listener and what they may do (mosquitto.conf(5) names).

    Attributes:
        allow_anonymous: clients without a verified user name may connect (the server layer's default: true on
            loopback and Unix socket listeners, false elsewhere).
        passwords: the ``password_file``, or ``None``.
        acl: the ``acl_file``, or ``None``: every client may do everything.
        use_identity_as_username: the verified client certificate's CN (``Connection.cert_cn``) is the user name
            when there is no ``password_file``.
    """

    allow_anonymous: bool = True
    passwords: PasswordCheck | None = None
    acl: AclRules | None = None
    use_identity_as_username: bool = False


#: A listener with no entry in ``BrokerSettings.access``: anyone, everything (the core's default, as before).
OPEN: Final = ListenerAccess()


def listener_access(core: BrokerState, listener: str) -> ListenerAccess:
    """The :class:`ListenerAccess` of ``listener`` (:data:`OPEN` when none was given)."""
    access: ListenerAccess = core.settings.access.get(listener, OPEN)
    return access


def authenticate(
    access: ListenerAccess, username: str | None, password: bytes | None, cert_cn: str | None
) -> tuple[str | None, RC | None, str]:
    """``(user name, refusal, why)``: the verified user name (``None``: anonymous) and ``None``, or the 5.0 Reason
    Code refusing the CONNECT (0x86 / 0x87; :mod:`~gateway.broker.reasons` maps them to 3.1.1's 4 / 5) and a
    Reason String."""
    user: str | None = None
    if access.passwords is not None:
        if username is not None:
            if not password:  # none, or zero-length: the same (Mosquitto reads an empty Password as absent)
                return None, RC.BAD_USER_NAME_OR_PASSWORD, "bad user name or password (no Password, or an empty one)"
            if not access.passwords.verify(username, password):
                return None, RC.BAD_USER_NAME_OR_PASSWORD, "bad user name or password"
            user = username
        elif password is not None:
            return None, RC.BAD_USER_NAME_OR_PASSWORD, "a Password without a User Name"
    elif access.use_identity_as_username:
        user = cert_cn
    if user is None and not access.allow_anonymous:
        return None, RC.NOT_AUTHORIZED, "anonymous clients are not allowed on this listener (allow_anonymous)"
    return user, None, ""


def client_rules(access: ListenerAccess, username: str | None, client_id: str) -> ClientRules | None:
    """The client's ACL rules, or ``None`` when the listener has no ``acl_file`` (everything allowed)."""
    return None if access.acl is None else access.acl.for_client(username, client_id)


def decide(rules: ClientRules | None, topic_filter: str) -> str:
    """``"none"``, ``"partial"`` or ``"all"``: how much of what ``topic_filter`` (without ``$share/<name>/``)
    matches the client may receive."""
    return "all" if rules is None else str(rules.subscribe(topic_filter).value)


def redecide(core: BrokerState, session: Session) -> None:
    """Decide each existing subscription of ``session`` again under ``session.acl`` (after a new connection, a
    restart or a reload). One that is no longer readable at all stays (no SUBACK can take it back) but is checked
    per message, so it receives nothing."""
    session.partial = NO_KEYS
    rules = session.acl
    if rules is None:
        return
    for key, record in session.subscriptions.items():
        if decide(rules, record.topic_filter) != "all":
            partial_for_write(session).add(key)


def may_read(session: Session, key: str, topic: str) -> bool:
    """Whether a message on ``topic`` may go to ``session`` through its subscription ``key`` (the filter as
    written): always for a subscription decided ALL, else ``read`` per message."""
    if key not in session.partial:
        return True
    rules = session.acl
    return rules is None or rules.may_receive(topic)


def reload(core: BrokerState, access: dict[str, ListenerAccess]) -> None:
    """Use new rules (SIGHUP): every session's ACL is resolved again from its listener's new ``acl_file`` and its
    subscriptions are decided again. Connections stay; a user removed from the password file keeps its current
    connection until it reconnects (as in Mosquitto)."""
    core.settings.access = access
    core.read_checks = any(a.acl is not None for a in access.values())
    for session in core.sessions.values():
        restore_rules(core, session)


def restore_rules(core: BrokerState, session: Session) -> None:
    """Resolve ``session.acl`` from the ACL of its listener (the first listener's for a session stored before
    sessions recorded theirs) and decide its subscriptions again."""
    access = core.settings.access
    entry = access.get(session.listener) if session.listener else None
    if entry is None:
        entry = next(iter(access.values()), OPEN)
    session.acl = client_rules(entry, session.username, session.client_id)
    redecide(core, session)
