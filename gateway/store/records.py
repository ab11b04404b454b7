"""On-disk record formats and keys of the LMDB store. Keys are big-endian so cursor order is FIFO order
(docs/architecture.md, "The durability contract"); values are compact binary records built from MQTT's own
encodings (UTF-8 strings with a 2-byte length, MQTT 5.0 properties), never pickles.

Named databases:

==========  ==========================================  =================================================
database    key                                         value
==========  ==========================================  =================================================
meta        name (ASCII)                                JSON
messages    mid (8 bytes BE)                            :func:`encode_message`
sessions    N(client id)                                :func:`encode_session`; when the key is hashed, the
                                                        client id (2-byte length, UTF-8) before it
subs        N(client id), 0x00, N(filter as written)    :func:`encode_subscription`; when the filter part is
                                                        hashed, the filter (2-byte length, UTF-8) after it
queue       N(client id), 0x00, seq (8 bytes BE)        :func:`encode_delivery` (inflight when packet_id != 0),
                                                        then the :func:`encode_message` record when no other
                                                        row references the message (:func:`inline_message`)
inbound     N(client id), 0x00, Packet Identifier (2)   mid (8), received_at (float64)
retained    N(topic)                                    mid (8 bytes BE); the topic is in the message record
outbox      N(upstream name), 0x00, seq (8 bytes BE)    :func:`encode_outbox`: mid (8), QoS (1), remote topic
==========  ==========================================  =================================================

N(name) is :func:`name_key`: the name's UTF-8 bytes when they are at most 160 bytes (``NAME_MAX``); a longer name
becomes a fixed 161-byte form (``HASHED_LEN``): its first bytes cut on a UTF-8 boundary (at most 96), padded with
0x01 to 97 bytes, then the 64-character hex SHA-256 of the whole name. So no key exceeds 161 + 1 + 161 = 323 bytes,
below LMDB's maximum key size (511 bytes by default), whatever a client sends (MQTT allows 65,535-byte Client
Identifiers, Topic Filters and Topic Names); a key that LMDB rejects would fail the whole group commit with
every other client's changes in it. A literal name (at most 160 bytes) and a hashed one (161) never
collide, having different lengths; two long names collide only if SHA-256 does. Client identifiers and topics
cannot contain U+0000 [MQTT-1.5.4-2] and the hashed form has no 0x00 either, so 0x00 separates key parts safely.
The full name comes back from the value where the loader needs it (sessions, subscriptions); queue and inbound
rows are matched to their session by the key part (:func:`split_key`), and retained rows take their topic from
the message record. The readable head keeps ``mdb_dump``/``store stats`` output recognisable.

Format 3 added the name form; stores of format 1 and 2 wrote names as they were, and are rewritten to it when
opened (:meth:`~gateway.store.lmdb_store.LmdbStore.load`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator
from typing import Final

from gateway.broker.message import NO_IDS, Delivery, Message
from gateway.broker.session_state import Session
from gateway.broker.subscription_tree import SubscriptionRecord
from gateway.mqtt.packets import PUBLISH, Will
from gateway.mqtt.primitives import decode_binary, decode_string, decode_vbi, encode_binary, encode_string
from gateway.mqtt.properties import NO_PROPERTIES, WILL, decode_properties, encode_properties

FORMAT_VERSION = 3  # 2: queue rows may carry their message (version 1 rows never do); 3: long names hashed in keys
FORMAT_VERSIONS = (1, 2, 3)  # what this code reads (1 and 2 are rewritten to 3 when a broker opens them)
NAME_MAX: Final = 160  # bytes: a longer name is hashed in keys (name_key)
HASHED_LEN: Final = 161  # bytes: the length of a hashed name part
_HEAD_MAX: Final = 96  # bytes of a long name kept readable in its hashed form
_HEAD_PAD: Final = 97  # the head padded with 0x01 to this length, then 64 hex characters

_MSG: Final = struct.Struct("!BBdd")  # qos, flags, received_at, expires_at (-1 = none)
_MSG_TOPIC: Final = struct.Struct("!BBddH")  # _MSG and the topic's length: the fixed head of decode_message
_DEL: Final = struct.Struct("!QBBHBdB")  # mid, qos, retain, packet_id, state, expires_at, n_sub_ids
_SESS: Final = struct.Struct("!dddB")  # expiry_interval, expires_at, will_at (-1 = none), protocol_level
_SUB: Final = struct.Struct("!BBBBI")  # qos, no_local, rap, retain_handling, sub_id (0 = none)
_INB: Final = struct.Struct("!Qd")
_OUT: Final = struct.Struct("!QB")  # mid, qos (then the remote topic)
_U64: Final = struct.Struct("!Q")
_U16: Final = struct.Struct("!H")
_TIMES: Final = struct.Struct("!dd")  # a message record's received_at and expires_at (decode_message)
_F64: Final = struct.Struct("!d")  # a queue row's expires_at (decode_queued)
_PATCH: Final = struct.Struct("!HB")  # a queue row's Packet Identifier and state (patch_delivery)
# The records' fixed sizes as compile-time constants (bytes): the compiled code reads them without an attribute
# lookup on the Struct.
_MSG_SIZE: Final = 18
_MSG_TOPIC_SIZE: Final = 20
_DEL_SIZE: Final = 22
_SESS_SIZE: Final = 25
_SUB_SIZE: Final = 8
_OUT_SIZE: Final = 9
assert (_MSG.size, _MSG_TOPIC.size, _DEL.size, _SESS.size, _SUB.size, _OUT.size) == \
    (_MSG_SIZE, _MSG_TOPIC_SIZE, _DEL_SIZE, _SESS_SIZE, _SUB_SIZE, _OUT_SIZE)
_NONE: Final = -1.0
#: The fixed head of a queue row (:func:`encode_delivery`): mid, QoS, RETAIN, Packet Identifier, state, expires_at
#: (-1.0 = none), number of Subscription Identifiers (4 bytes each follow). For loaders that skip the rest.
DELIVERY_HEAD = _DEL
#: An 8-byte big-endian integer (mids, seqs).
U64 = _U64


def u64(value: int) -> bytes:
    """8-byte big-endian integer."""
    return value.to_bytes(8, "big")  # compiled: a third of the time of _U64.pack


def from_u64(data: bytes, pos: int = 0) -> int:
    """Read an 8-byte big-endian integer at ``pos``. Raises ``IndexError`` when ``data`` ends before it."""
    # Byte by byte: compiled, these are C integer operations; Struct.unpack_from makes a tuple and a call.
    return ((data[pos] << 56) | (data[pos + 1] << 48) | (data[pos + 2] << 40) | (data[pos + 3] << 32)
            | (data[pos + 4] << 24) | (data[pos + 5] << 16) | (data[pos + 6] << 8) | data[pos + 7])


def name_key(name: str) -> bytes:
    """The key part of a name (client id, Topic Filter, topic, upstream link name): its UTF-8 bytes when they are
    at most ``NAME_MAX`` (160) bytes, else the fixed ``HASHED_LEN`` (161) byte form: the first bytes cut on a
    UTF-8 boundary (at most 96), padded with 0x01 to 97 bytes, then the hex SHA-256 of the whole name. See the
    module docstring; callers on hot paths cache the result (``LmdbStore._prefix``)."""
    data = name.encode("utf-8")
    if len(data) <= NAME_MAX:
        return data
    return hashed_name(data)


def hashed_name(data: bytes) -> bytes:
    """The hashed form of a name's UTF-8 bytes ``data`` (longer than ``NAME_MAX``), ``HASHED_LEN`` bytes."""
    cut = _HEAD_MAX
    while cut and data[cut] & 0xC0 == 0x80:  # a continuation byte: the character started before the cut
        cut -= 1
    head = data[:cut]
    return head + b"\x01" * (_HEAD_PAD - len(head)) + hashlib.sha256(data).hexdigest().encode("ascii")


def is_hashed(part: bytes) -> bool:
    """True when a key part is a hashed name (then the full name is in the row's value, or elsewhere)."""
    return len(part) == HASHED_LEN


def client_prefix(client_id: str) -> bytes:
    """The key prefix of all rows of one session in ``subs``, ``queue`` and ``inbound`` (and of one upstream link
    in ``outbox``): :func:`name_key` and 0x00."""
    return name_key(client_id) + b"\x00"


def split_key(key: bytes) -> tuple[bytes, bytes]:
    """``(name part, rest)`` of a ``subs``/``queue``/``inbound``/``outbox`` key: the name part is the key of the
    owner's ``sessions`` row (a literal name or a hashed one, :func:`name_key`)."""
    part, _, rest = key.partition(b"\x00")
    return part, rest


def split_client_key(key: bytes) -> tuple[str, bytes]:
    """``(client_id, rest)`` of a ``subs``/``queue``/``inbound`` key whose name part is literal (a client id of at
    most ``NAME_MAX`` bytes, or any key of a format 1/2 store); a hashed part decodes to its hashed form."""
    cid, _, rest = key.partition(b"\x00")
    return cid.decode("utf-8", "replace"), rest


def _opt(value: float | None) -> float:
    return _NONE if value is None else value


def _unopt(value: float) -> float | None:
    return None if value == _NONE else value


_NAMES: Final[dict[tuple[str, str | None], bytes]] = {}  # (topic, sender) -> their encoding; a few thousand at most


def encode_message(m: Message) -> bytes:
    """A stored Application Message: header, topic, sender, PUBLISH properties, payload. The encoded topic and
    sender are cached (publishers repeat them); the cache is emptied when it reaches 4096 pairs."""
    names = _NAMES.get((m.topic, m.sender))
    if names is None:
        if len(_NAMES) >= 4096:
            _NAMES.clear()
        names = _NAMES[(m.topic, m.sender)] = encode_string(m.topic) + encode_string(m.sender or "")
    return b"".join((
        _MSG.pack(m.qos, 1 if m.retain else 0, m.received_at, _opt(m.expires_at)),
        names,
        encode_properties(m.properties) if m.properties else b"\x00",
        m.payload,
    ))


def decode_message(mid: int, data: bytes, pos: int = 0) -> Message:
    """Inverse of :func:`encode_message`, for the record at ``pos`` (on the paths that page queues back in: no
    re-validation of what :func:`encode_message` wrote). Raises ``MalformedPacket``/``struct.error``/``IndexError``/
    ``UnicodeDecodeError`` on a damaged record."""
    # The bytes read one by one and the two doubles with one struct call: compiled, a third of the time of
    # unpacking _MSG_TOPIC's five fields into a tuple (the drain decodes every paged-in message here).
    qos = data[pos]
    flags = data[pos + 1]
    received_at, expires_at = _TIMES.unpack_from(data, pos + 2)
    n = (data[pos + 18] << 8) | data[pos + 19]
    pos += _MSG_TOPIC_SIZE
    topic = data[pos:pos + n].decode("utf-8")
    pos += n
    n = (data[pos] << 8) | data[pos + 1]
    pos += 2
    sender = data[pos:pos + n].decode("utf-8") if n else None
    pos += n
    if data[pos] == 0:
        props, pos = NO_PROPERTIES, pos + 1
    else:
        props, pos = decode_properties(data, pos, PUBLISH)
    return Message(mid, topic, data[pos:], qos, bool(flags & 1), props, received_at, _unopt(expires_at), sender)


def payload_length(data: bytes) -> int:
    """The payload length (bytes) of a stored message record, without decoding it. Raises ``IndexError`` on a
    damaged record."""
    return payload_length_at(data, 0)


def payload_length_at(data: bytes, pos: int) -> int:
    """The payload length (bytes) of the message record at ``pos`` of ``data`` (to the end of ``data``), without
    decoding or copying it. Raises ``IndexError``/``struct.error`` on a damaged record."""
    pos += _MSG_SIZE
    pos += 2 + _U16.unpack_from(data, pos)[0]  # topic
    pos += 2 + _U16.unpack_from(data, pos)[0]  # sender
    if data[pos] == 0:  # no properties: the usual case
        return len(data) - pos - 1
    length, pos = decode_vbi(data, pos)  # Property Length
    return len(data) - pos - length


def encode_delivery(d: Delivery) -> bytes:
    """A queue/inflight entry referencing its message by mid."""
    head = _DEL.pack(d.message.mid, d.qos, 1 if d.retain else 0, d.packet_id, d.state, _opt(d.expires_at),
                     len(d.sub_ids))
    if not d.sub_ids:
        return head
    return head + struct.pack(f"!{len(d.sub_ids)}I", *d.sub_ids)


def decode_queued(value: bytes, seq: int, stored: bytes | None = None) -> Delivery:
    """A queue row read back to be delivered: its delivery with the message the row carries
    (:func:`inline_message`), else the one in ``stored`` (the ``messages`` row it references); marked ``dropped``
    when neither is there (a damaged store). One pass over the row: the paging hot path."""
    # The head read field by field (as decode_message does): compiled, a fraction of unpacking _DEL's seven
    # fields into a tuple; every paged-in delivery passes here.
    mid = from_u64(value, 0)
    qos = value[8]
    retain = value[9]
    packet_id = (value[10] << 8) | value[11]
    state = value[12]
    expires_at: float = _F64.unpack_from(value, 13)[0]
    n = value[21]
    pos = _DEL_SIZE
    sub_ids = list(struct.unpack_from(f"!{n}I", value, pos)) if n else NO_IDS
    pos += 4 * n
    dropped = False
    if len(value) > pos:
        message = decode_message(mid, value, pos)
    elif stored is not None:
        message = decode_message(mid, stored)
    else:
        message = Message(mid, "", b"", 0, False, NO_PROPERTIES, 0.0)
        dropped = True
    return Delivery(message, qos, bool(retain), sub_ids, packet_id, state, 0.0, _unopt(expires_at), dropped, seq)


def decode_queue_rows(rows: Iterator[tuple[bytes, bytes]], start: int, last: bytes, limit: int,
                      stored: Callable[[bytes], bytes | None]) -> list[Delivery]:
    """Up to ``limit`` queue rows of one session from ``rows`` (``(key, value)`` in key order, from the first
    wanted), up to and including key ``last``, each with its message (:func:`decode_queued`): the one the row
    carries, else ``stored(mid)`` (the ``messages`` row by its 8-byte key). ``start`` is the length of the
    session's key prefix (the seq follows it). The paging hot path, one pass over LMDB's cursor."""
    out: list[Delivery] = []
    if limit <= 0:
        return out
    for key, value in rows:
        if key > last:
            break
        seq = from_u64(key, start)
        if carries_message(value):
            out.append(decode_queued(value, seq))
        else:
            # The record starts with the mid, as the message row's key is made.
            out.append(decode_queued(value, seq, stored(value[:8])))
        if len(out) >= limit:
            break
    return out


def carries_message(data: bytes) -> bool:
    """True when a queue row carries its message (:func:`inline_message` is not ``None``), without copying it."""
    return len(data) > _DEL_SIZE + 4 * data[_DEL_SIZE - 1]


def inline_message(data: bytes) -> bytes | None:
    """The message record a queue row carries after its :func:`encode_delivery` record (a message that nothing
    else referenced when it was stored: it is stored once, in that row), or ``None`` when the row references a
    ``messages`` row by mid."""
    size = _DEL_SIZE + 4 * data[_DEL_SIZE - 1]
    return data[size:] if len(data) > size else None


def patch_delivery(data: bytes, packet_id: int, state: int) -> bytes:
    """:func:`encode_delivery`'s record ``data`` with another Packet Identifier and state (a send, or PUBREC
    received), the rest kept as it is."""
    return data[:10] + _PATCH.pack(packet_id, state) + data[13:]


def decode_delivery(data: bytes, message: Message | None = None) -> tuple[int, Delivery]:
    """``(mid, delivery)`` of :func:`encode_delivery`'s record; the delivery's ``message`` is ``message`` or a
    placeholder until the caller links it."""
    mid, qos, retain, packet_id, state, expires_at, n = _DEL.unpack_from(data, 0)
    sub_ids = list(struct.unpack_from(f"!{n}I", data, _DEL_SIZE)) if n else NO_IDS
    if message is None:
        message = Message(mid, "", b"", 0, False, NO_PROPERTIES, 0.0)
    return mid, Delivery(message, qos, bool(retain), sub_ids, packet_id, state, 0.0, _unopt(expires_at))


def encode_will(will: Will | None) -> bytes:
    """The Will Message of a session (topic, payload, QoS, retain, Will Properties), or empty."""
    if will is None:
        return b""
    return b"".join((
        bytes((will.qos | (0x04 if will.retain else 0),)),
        encode_string(will.topic),
        encode_binary(will.payload),
        encode_properties(will.properties),
    ))


def decode_will(data: bytes, pos: int) -> Will | None:
    """Inverse of :func:`encode_will` starting at ``pos``."""
    if pos >= len(data):
        return None
    flags = data[pos]
    topic, pos = decode_string(data, pos + 1)
    payload, pos = decode_binary(data, pos)
    props, pos = decode_properties(data, pos, WILL)
    return Will(topic, payload, flags & 0x03, bool(flags & 0x04), props)


#: Set in the protocol level byte of a session record when its owner follows: a byte 1 (a verified user
#: name follows) or 0 (anonymous), the user name if any, and the listener name, before the Will. Records without
#: it (written before session ownership existed) load as anonymous sessions of an unknown listener. A version
#: without session ownership would misread a record with it: do not run one on a store this version has written.
_OWNER: Final = 0x80


def encode_session(s: Session) -> bytes:
    """Session meta: expiry, offline deadline, delayed Will, and its owner (user name and listener)."""
    owner = b""
    level = s.protocol_level
    if s.username is not None or s.listener:
        level |= _OWNER
        owner = (b"\x01" + encode_string(s.username) if s.username is not None else b"\x00") + encode_string(
            s.listener
        )
    return _SESS.pack(float(s.expiry_interval), _opt(s.expires_at), _opt(s.will_at), level) + owner + \
        encode_will(s.will if s.will_at is not None else None)


def session_row(s: Session, key: bytes) -> bytes:
    """The ``sessions`` value of ``s`` under ``key`` (its :func:`name_key`): :func:`encode_session`, after the
    client id when the key is hashed."""
    if len(key) == HASHED_LEN:
        return encode_string(s.client_id) + encode_session(s)
    return encode_session(s)


def session_id(key: bytes, value: bytes, hashed_keys: bool = True) -> tuple[str, bytes]:
    """``(client id, encode_session record)`` of a ``sessions`` row. ``hashed_keys`` False for a format 1/2 store,
    whose keys are the client ids as they are."""
    if hashed_keys and len(key) == HASHED_LEN:
        client_id, pos = decode_string(value, 0)
        return client_id, value[pos:]
    return key.decode("utf-8"), value


def decode_session_into(s: Session, data: bytes) -> None:
    """Fill ``s`` from an :func:`encode_session` record."""
    expiry, expires_at, will_at, level = _SESS.unpack_from(data, 0)
    s.expiry_interval = expiry
    s.expires_at = _unopt(expires_at)
    s.will_at = _unopt(will_at)
    s.protocol_level = level & ~_OWNER
    pos = _SESS_SIZE
    if level & _OWNER:
        if data[pos]:
            s.username, pos = decode_string(data, pos + 1)
        else:
            pos += 1
        s.listener, pos = decode_string(data, pos)
    s.will = decode_will(data, pos)
    if s.will is None:
        s.will_at = None


def encode_subscription(r: SubscriptionRecord, filter_part: bytes = b"") -> bytes:
    """A subscription with its options; the key carries the filter as written (``filter_part``, its
    :func:`name_key`), and when that part is hashed the filter follows the options here."""
    head = _SUB.pack(r.qos, r.no_local, r.retain_as_published, r.retain_handling, r.sub_id or 0)
    if len(filter_part) == HASHED_LEN:
        return head + encode_string(r.key)
    return head


def subscription_key(key: bytes, data: bytes) -> str:
    """The filter as written of a ``subs`` row: from the value when it carries it (a hashed key part), else the
    key's part after the client's prefix (``key`` is that part)."""
    if len(data) > _SUB_SIZE:
        return decode_string(data, _SUB_SIZE)[0]
    return key.decode("utf-8")


def decode_subscription(client_id: str, key: str, data: bytes) -> SubscriptionRecord:
    """Inverse of :func:`encode_subscription`; ``key`` is the filter as written (``$share/...`` kept)."""
    qos, no_local, rap, rh, sub_id = _SUB.unpack_from(data, 0)
    group = None
    topic_filter = key
    if key.startswith("$share/"):
        group, _, topic_filter = key[7:].partition("/")
    return SubscriptionRecord(client_id, topic_filter, qos, bool(no_local), bool(rap), rh, sub_id or None, group)


def encode_inbound(mid: int, received_at: float) -> bytes:
    """An inbound QoS 2 entry awaiting PUBREL."""
    return _INB.pack(mid, received_at)


def decode_inbound(data: bytes) -> tuple[int, float]:
    """``(mid, received_at)``."""
    mid, received_at = _INB.unpack_from(data, 0)
    return mid, received_at


def encode_outbox(mid: int, qos: int, topic: str) -> bytes:
    """An upstream outbox entry: the message by mid, the QoS and the remote topic it is forwarded at/to."""
    return _OUT.pack(mid, qos) + encode_string(topic)


def decode_outbox(data: bytes) -> tuple[int, int, str]:
    """``(mid, qos, remote topic)``."""
    mid, qos = _OUT.unpack_from(data, 0)
    topic, _ = decode_string(data, _OUT_SIZE)
    return mid, qos, topic
