"""Batches on the loop's side of the LMDB store's group commit: the open batch, the batches handed to the writer
thread and not yet committed, and the last commit barrier of each (docs/architecture.md, "The durability
contract": all work of one loop turn, or of a few milliseconds, shares one fsynced transaction).

:class:`CommitBatches` sits between :class:`~gateway.store.writer.LmdbWriter` (the writer thread, which commits a
batch and reports back through ``_committed``) and :class:`~gateway.store.lmdb_store.LmdbStore` (the typed
operations, which record changes here with ``_record``):

- the open batch: operations (``_ops``), the row patches of sends not yet recorded (``_sent``), and the id of the
  last commit barrier put after them (``_barrier``); handed over at the end of the loop turn (or after
  ``commit_interval``; changes nobody waits for wait up to ``lazy_commit`` to share a commit with later work);
- the batches in flight, in order (``_inflight``: the last barrier of each, 0 for none; ``_inflight_seq``): when
  the writer reports, the last barrier of the batches it committed goes to ``on_committed``, or of those it could
  not commit to ``on_failed``. The core holds the acknowledgements and decides what a failure refuses
  (:mod:`gateway.broker.barriers`); a barrier with nothing open joins the last batch in flight, to keep the
  acknowledgements in order;
- the owners of changes a commit left out (they failed alone), named by client id before that commit's barrier is
  reported (``on_change_failed``), through the key prefixes the typed operations used (``_prefix``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from gateway.broker.message import Delivery
from gateway.store import records as rec
from gateway.store.open_batch import Q_SENT, OpenBatch
from gateway.store.settings import StoreSettings
from gateway.store.writer import LmdbWriter

log = logging.getLogger("gateway.store")

_T = TypeVar("_T")


class _OpenField(Generic[_T]):
    """An attribute of the store that is its open batch's (``_open``) attribute ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, store: CommitBatches, owner: type | None = None) -> _T:
        value: _T = getattr(store._open, self.name)
        return value

    def __set__(self, store: CommitBatches, value: _T) -> None:
        setattr(store._open, self.name, value)


class CommitBatches(LmdbWriter):
    """The open batch and the batches in flight of an LMDB store, and their commit barriers (see the module's
    docstring); the base of :class:`~gateway.store.lmdb_store.LmdbStore`.

    Args:
        settings: the ``[store]`` settings (``group_commit``, ``commit_interval``, ``lazy_commit`` are read here).
    """

    def __init__(self, settings: StoreSettings) -> None:
        super().__init__(settings)
        #: Called on the loop after the writer reported batches (the I/O layer flushes what the reports caused).
        self.on_batch_done: Callable[[], None] | None = None
        #: Called on the loop with the last commit barrier of the batches a commit wrote (``Broker.committed``).
        self.on_committed: Callable[[int], None] | None = None
        #: Called on the loop with the last commit barrier of the batches a commit could not write, and whether for
        #: lack of room (``Broker.failed``).
        self.on_failed: Callable[[int, bool], None] | None = None
        #: Called on the loop with the client ids whose changes were left out of a commit (they failed alone),
        #: before that commit's barrier is reported: the broker closes their connections so that nothing of
        #: theirs is acknowledged (``Broker.store_change_failed``).
        self.on_change_failed: Callable[[set[str]], None] | None = None
        #: The open batch (compiled with the core: the store's per-message operations are its methods).
        self._open = OpenBatch(self._schedule, self._bring_forward)
        self._group_commit = settings.group_commit
        self._lazy_handle: asyncio.TimerHandle | None = None
        self._open.eager = not self._group_commit
        #: Commit barrier ``barrier`` after everything recorded so far (the port's ``SessionStore.barrier``; the
        #: open batch's own, compiled: :meth:`~gateway.store.open_batch.OpenBatch.barrier`).
        self.barrier: Callable[[int], int] = self._open.barrier
        # Every queue row with a seq <= this was committed, except those reported to on_queue_rows_lost first.
        self.committed_seq = 0
        self._inflight_seq: deque[int] = deque()
        self.waiting_since = 0.0  # when the oldest batch still uncommitted was handed over

    # The open batch's state, under the names the rest of the store reads and writes (once per batch or per rarer
    # change; the per-message operations are the open batch's own methods).
    _ops: _OpenField[list[tuple[Any, ...]]] = _OpenField("ops")
    _sent: _OpenField[dict[int, tuple[str, Delivery]]] = _OpenField("sent")
    _changed: _OpenField[bool] = _OpenField("changed")
    _submit_scheduled: _OpenField[bool] = _OpenField("submit_scheduled")
    _seq: _OpenField[int] = _OpenField("seq")  # the next queue (or outbox) row's store sequence number
    _next_mid_hint: _OpenField[int] = _OpenField("next_mid_hint")
    _barrier: _OpenField[int] = _OpenField("barrier_id")  # the open batch's last commit barrier (0: none)
    _inflight: _OpenField[deque[int]] = _OpenField("inflight")  # the last barrier of each batch in flight
    _long_names: _OpenField[dict[bytes, str]] = _OpenField("long_names")  # hashed key part -> its client id

    @property
    def _lazy(self) -> asyncio.TimerHandle | None:
        """A submit of changes nobody waits for, not yet due (a barrier brings it forward)."""
        return self._lazy_handle

    @_lazy.setter
    def _lazy(self, handle: asyncio.TimerHandle | None) -> None:
        self._lazy_handle = handle
        self._open.eager = handle is not None or not self._group_commit

    def attach(self, loop: asyncio.AbstractEventLoop, on_batch_done: Callable[[], None] | None = None) -> None:
        """Bind to the event loop that records changes and gets the commit reports."""
        self.loop = loop
        self.on_batch_done = on_batch_done

    def _owner_ids(self, owners: tuple[set[bytes], set[str]]) -> set[str]:
        parts, names = owners
        ids = set(names)
        for part in parts:
            if rec.is_hashed(part):
                cid = self._long_names.get(part)
                if cid is None:
                    log.error("store: the owner of key part %r is not known; its connection stays open", part)
                    continue
                ids.add(cid)
            else:
                ids.add(part.decode("utf-8", "replace"))
        return ids

    def _committed(self, count: int, ok: bool = True, full: bool = True,
                   owners: tuple[set[bytes], set[str]] | None = None) -> None:
        """``count`` batches in flight were committed (``ok``) or could not be (``full``: for lack of room): report
        the last barrier among them to ``on_committed`` or ``on_failed``. Clients whose changes were left out
        (``owners``) are reported first, so that their acknowledgements are not sent."""
        if owners is not None and self.on_change_failed is not None:
            try:
                self.on_change_failed(self._owner_ids(owners))
            except Exception:
                log.exception("store: on_change_failed failed")
        last = 0
        for _ in range(count):
            if not self._inflight:
                break
            barrier = self._inflight.popleft()
            seq = self._inflight_seq.popleft()
            if barrier:
                last = barrier
            if ok:
                self.committed_seq = seq
        if last:
            try:
                if ok:
                    if self.on_committed is not None:
                        self.on_committed(last)
                elif self.on_failed is not None:
                    self.on_failed(last, full)
            except Exception:
                log.exception("store: reporting barrier %d failed", last)
        if self.on_batch_done is not None:
            self.on_batch_done()

    def _schedule(self) -> None:
        if self._submit_scheduled:
            return
        self._submit_scheduled = True
        loop = self.loop
        if loop is None:
            # No event loop (tools, unit tests): commit synchronously in the caller (a barrier then finds nothing
            # open: DURABLE).
            self._submit_scheduled = False
            ops = self._take_ops()
            barrier, self._barrier = self._barrier, 0
            ok = self._commit(ops)
            owners = self._take_skipped()
            if owners is not None and self.on_change_failed is not None:
                self.on_change_failed(self._owner_ids(owners))
            if ok:
                self.committed_seq = self._seq - 1
            if barrier and ok and self.on_committed is not None:
                self.on_committed(barrier)
            elif barrier and not ok and self.on_failed is not None:
                self.on_failed(barrier, self.last_failure_full)
        elif self.settings.commit_interval > 0:
            loop.call_later(self.settings.commit_interval, self._submit)
        elif self._barrier or not self.settings.group_commit or not self.settings.lazy_commit:
            loop.call_soon(self._submit)
        else:
            # Nobody waits for these changes yet (deletes after acknowledgements, Packet Identifier updates,
            # QoS 0 queue rows): let them gather for a few milliseconds; a barrier brings the commit forward.
            self._lazy = loop.call_later(self.settings.lazy_commit, self._submit)

    def _submit(self) -> None:
        self._submit_scheduled = False
        if self._lazy is not None:
            self._lazy.cancel()
            self._lazy = None
        barrier = self._barrier
        self._barrier = 0
        if not self._ops and not self._sent:
            # Nothing to write (not expected: a barrier joins the open batch only when it holds changes).
            if barrier and self._inflight:
                self._inflight[-1] = barrier
            elif barrier and self.on_committed is not None:
                self.on_committed(barrier)
            return
        ops = self._take_ops()
        if not self._inflight:
            self.waiting_since = time.monotonic()
        self._inflight.append(barrier)
        self._inflight_seq.append(self._seq - 1)
        self._queue.put((ops, self._next_mid_hint, self._seq))

    def _take_ops(self) -> list[tuple[Any, ...]]:
        """The open batch, with the row patches of the sends in it last (after any new row they patch)."""
        ops, self._ops = self._ops, []
        self._changed = False
        if self._sent:
            prefix, u64 = self._prefix, rec.u64
            ops.extend((Q_SENT, prefix(cid) + u64(seq), d.packet_id, d.state) for seq, (cid, d) in self._sent.items())
            self._sent = {}
        return ops

    def _record(self, op: tuple[Any, ...]) -> None:
        self._open.record(op)

    def _prefix(self, client_id: str) -> bytes:
        """The key prefix of ``client_id``'s rows (``records.client_prefix``), cached; a hashed one is remembered
        with its client id (to name the owner of a change that fails, :meth:`_owner_ids`)."""
        return self._open.prefix(client_id)

    def _bring_forward(self) -> None:
        """A barrier joined the open batch: without group commit, hand it over now; else commit at the end of this
        loop turn, not when the lazy timer fires."""
        if not self._group_commit:
            self._submit()
            return
        assert self._lazy is not None and self.loop is not None
        self._lazy.cancel()
        self._lazy = None
        self._submit_scheduled = True
        self.loop.call_soon(self._submit)

    def pending(self) -> bool:
        """True while recorded changes or commit barriers wait for a commit."""
        return bool(self._ops or self._barrier or self._sent or self._inflight)

    def healthy(self, max_age: float = 30.0) -> bool:
        """True while the writer thread is alive and not stuck on a batch (for the systemd watchdog)."""
        if self._writer is None or not self._writer.is_alive():
            return False
        since = max(self.last_commit_at, self.waiting_since)  # an idle store's first batch is not late
        return not (self._inflight and time.monotonic() - since > max_age)

    def _hand_over_last(self) -> None:
        """On close: cancel a lazy commit and hand the open batch, if any, to the writer thread (still running)."""
        if self._lazy is not None:
            self._lazy.cancel()
            self._lazy = None
        if self._writer is not None and (self._ops or self._sent):
            ops = self._take_ops()
            self._inflight.append(self._barrier)
            self._inflight_seq.append(self._seq - 1)
            self._barrier = 0
            self._queue.put((ops, self._next_mid_hint, self._seq))
