"""The named databases ("tables") of the LMDB store, by name (their keys and values are described in
:mod:`gateway.store.records`).

Code addresses a table as ``tables.queue``, never by a position: :class:`Tables` is opened once per environment
(:meth:`Tables.open`) and held by the store. A table's LMDB name is its field name; the order of ``DB_NAMES`` is
the order in which ``store stats`` lists them and ``store compact`` copies them (it is not part of the format).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import lmdb


@dataclass(frozen=True, slots=True)
class Tables:
    """The handles of the store's named databases (``lmdb._Database``), one per table.

    Attributes:
        meta: format version, ``next_mid``, ``next_seq`` (ASCII numbers).
        messages: message records shared by several rows, by mid.
        sessions: persistent sessions, by client id.
        subs: subscriptions, by client id and Topic Filter.
        queue: Message Queue and inflight rows, by client id and seq.
        inbound: QoS 2 messages awaiting PUBREL, by client id and Packet Identifier.
        retained: retained messages, by topic.
        outbox: upstream outbox rows, by upstream name and seq.
    """

    meta: Any
    messages: Any
    sessions: Any
    subs: Any
    queue: Any
    inbound: Any
    retained: Any
    outbox: Any

    @classmethod
    def open(cls, env: lmdb.Environment) -> Tables:
        """Open (creating when missing) every table of ``env``."""
        return cls(*(env.open_db(name.encode()) for name in DB_NAMES))

    def __iter__(self) -> Iterator[Any]:
        """The handles in ``DB_NAMES`` order (spelled out: the writer sums the tables' sizes on opening)."""
        return iter((self.meta, self.messages, self.sessions, self.subs, self.queue, self.inbound, self.retained,
                     self.outbox))

    def items(self) -> Iterator[tuple[str, Any]]:
        """(name, handle) pairs in ``DB_NAMES`` order."""
        return zip(DB_NAMES, self, strict=True)

    def name_of(self, db: Any) -> str:
        """The name of the table whose handle is ``db`` (for log lines)."""
        return next((name for name, handle in self.items() if handle is db), "?")


DB_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Tables))
