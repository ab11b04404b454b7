"""Reading a persistent session's queue rows back from the LMDB store as its Message Queue drains (queue paging,
:mod:`gateway.broker.mqueue`; the interface is :class:`gateway.broker.queue_pager.QueuePager`)."""

from __future__ import annotations

import threading
from typing import Protocol

import lmdb

from gateway.broker.message import Delivery
from gateway.store import records as rec
from gateway.store.tables import Tables


class PagedStore(Protocol):
    """What a pager reads of its store (:class:`~gateway.store.lmdb_store.LmdbStore`)."""

    env: lmdb.Environment | None
    tables: Tables
    map_lock: threading.Lock  # held while reading: the writer may not resize the map meanwhile
    committed_seq: int  # every queue row with a seq up to this is committed (updated on the loop)


class LmdbPager:
    """The :class:`~gateway.broker.queue_pager.QueuePager` of one session: reads its committed queue rows.

    The store keeps a weak index of its pagers by key prefix (``prefix``), to name the session of a queue row that a
    commit did not write (:meth:`~gateway.store.lmdb_store.LmdbStore._rows_not_written`)."""

    __slots__ = ("__weakref__", "client_id", "prefix", "store")

    def __init__(self, store: PagedStore, client_id: str) -> None:
        self.store = store
        self.client_id = client_id
        self.prefix = rec.client_prefix(client_id)

    def committed_seq(self) -> int:
        """The highest store sequence number known committed (updated as commits land on the loop)."""
        return self.store.committed_seq

    def read(self, after: int, upto: int, limit: int) -> list[Delivery]:
        """Up to ``limit`` committed queue rows of this session with ``after < seq <= upto``, in order, each with
        its message read back (one read transaction on the calling thread; held under ``map_lock`` so the writer
        cannot resize the map meanwhile). A row whose message row is missing comes back marked ``dropped``."""
        store = self.store
        assert store.env is not None
        prefix = self.prefix
        messages, queue_db = store.tables.messages, store.tables.queue
        with store.map_lock, store.env.begin() as txn:
            cursor = txn.cursor(db=queue_db)
            if not cursor.set_range(prefix + rec.u64(after + 1)):
                return []
            # Keys sort as (client, seq): past prefix + upto is past the range.
            return rec.decode_queue_rows(cursor.iternext(), len(prefix), prefix + rec.u64(upto), limit,
                                         lambda mid: txn.get(mid, db=messages))
