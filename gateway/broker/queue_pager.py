"""How a Message Queue reads its paged entries back from the store (:mod:`gateway.broker.mqueue`); the store
implements it (``gateway.store.lmdb_store``). Apart from :mod:`gateway.broker.store_port` so that the queue depends on
this alone (session -> mqueue -> pager, no cycle through the store interface)."""

from __future__ import annotations

from typing import Protocol

from gateway.broker.message import Delivery


class QueuePager(Protocol):
    """Reads back the committed Message Queue rows of one persistent session (queue paging, see
    :mod:`gateway.broker.mqueue`). Called on the event loop; reads never wait for the writer."""

    def committed_seq(self) -> int:
        """The highest store sequence number whose queue row is committed (or was committed and later deleted)."""
        ...

    def read(self, after: int, upto: int, limit: int) -> list[Delivery]:
        """Up to ``limit`` committed queue rows with ``after < seq <= upto``, in order, as Deliveries (``seq``
        set, message read back). Rows deleted since are absent; rows whose deletion is not committed yet are
        still returned (the queue skips them); a row whose message is missing is returned marked ``dropped``."""
        ...
