"""The ``[store]`` settings of the LMDB store (read by :mod:`gateway.server.config`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StoreSettings:
    """``[store]`` settings.

    Attributes:
        path: directory of the LMDB environment.
        max_size: largest the data may grow, bytes.
        commit_interval: extra seconds a batch waits for more work before it is handed to the writer (default 0:
            the end of the loop turn; whatever arrives while the writer is busy joins the next commit anyway).
        on_corrupt: ``"quarantine"`` (move aside, start empty) or ``"refuse"`` (raise :class:`StoreError`).
        group_commit: False commits every acknowledged unit of work alone (one fsync per message): only for
            measuring what group commit buys (``bench/durable.py``).
        mqueue_mem_len: queued messages of a persistent session kept in memory; the rest wait only in the
            store and are paged in as the queue drains (0 = all in memory).
        lazy_commit: seconds that changes nobody waits for (deletes after acknowledgements, Packet Identifier
            updates of QoS 1 sends, QoS 0 queue rows, offline deadlines) may wait to share a commit with later
            work; anything a client waits for is committed at the end of the loop turn as before. A crash can
            undo at most this much of such changes, so a QoS 1 message may come again; nothing acknowledged is
            lost. Draining a backlog takes about a tenth of the fsyncs (less flash wear).
    """

    path: str = "var"
    max_size: int = 1024 * 1024 * 1024
    commit_interval: float = 0.0
    on_corrupt: str = "quarantine"
    group_commit: bool = True
    mqueue_mem_len: int = 1000
    lazy_commit: float = 0.005
