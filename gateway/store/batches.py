"""Batches on the loop's side of the LMDB store's group commit (DESIGN.md §4): the open batch, the batches handed
to the writer thread and not yet committed, and the ``when_durable`` callbacks waiting on each.

:class:`CommitBatches` sits between :class:`~gateway.store.writer.LmdbWriter` (the writer thread, which commits a
batch and reports back through ``_committed``) and :class:`~gateway.store.lmdb_store.LmdbStore` (the typed
operations, which record changes here with ``_record``):

- the open batch: operations (``_ops``), the row patches of sends not yet recorded (``_sent``), and its
  ``when_durable`` callbacks and ``on_failure`` callbacks, in order; handed over at the end of the loop turn (or
  after ``commit_interval``; changes nobody waits for wait up to ``lazy_commit`` to share a commit with later work);
- the batches in flight, in order (``_inflight``, ``_inflight_fail``, ``_inflight_seq``): when the writer reports
  a commit, their callbacks run on the loop; when it reports a failure, their ``on_failure`` callbacks run instead;
- riders: a ``when_durable`` with nothing open and every batch in flight handed over in an earlier loop turn owns
  no change in them (a handler records and asks in one turn), so it completes after those batches whether they
  commit or fail: another client's failed commit never refuses it;
- the owners of changes a commit left out (they failed alone), named by client id before that commit's callbacks
  run (``on_change_failed``), through the key prefixes the typed operations used (``_prefix``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gateway.broker.message import Delivery
from gateway.store import records as rec
from gateway.store.settings import StoreSettings
from gateway.store.writer import _Q_SENT, LmdbWriter

log = logging.getLogger("gateway.store")


class CommitBatches(LmdbWriter):
    """The open batch and the batches in flight of an LMDB store, and their ``when_durable`` callbacks (see the
    module's docstring); the base of :class:`~gateway.store.lmdb_store.LmdbStore`.

    Args:
        settings: the ``[store]`` settings (``group_commit``, ``commit_interval``, ``lazy_commit`` are read here).
    """

    def __init__(self, settings: StoreSettings) -> None:
        super().__init__(settings)
        self.on_callbacks_done: Callable[[], None] | None = None
        #: Called on the loop with the client ids whose changes were left out of a commit (they failed alone),
        #: before that commit's ``when_durable`` callbacks run: the broker closes their connections so that
        #: nothing of theirs is acknowledged (``Broker.store_change_failed``).
        self.on_change_failed: Callable[[set[str]], None] | None = None
        self._ops: list[tuple[Any, ...]] = []
        #: Sends of stored deliveries whose row is not patched yet, by seq: (client id, delivery). Turned into
        #: _Q_SENT operations when the batch is handed over; a delivery deleted before that needs none.
        self._sent: dict[int, tuple[str, Delivery]] = {}
        self._cbs: list[Callable[[], None]] = []
        self._fails: list[Callable[[bool], None]] = []  # the open batch's on_failure callbacks, in order
        self._inflight: deque[list[Callable[[], None]]] = deque()
        self._inflight_fail: deque[list[Callable[[bool], None]]] = deque()
        #: A batch was handed over by when_durable itself (group_commit off) in this loop turn: a later callback of
        #: this turn may own changes in it (recorded before a nested when_durable), so it is not a rider.
        self._submitted_this_turn = False
        self._submit_scheduled = False
        self._lazy: asyncio.TimerHandle | None = None  # a submit of changes nobody waits for, not yet due
        # Every queue row with a seq <= this was committed, except those reported to on_queue_rows_lost first.
        self.committed_seq = 0
        self._inflight_seq: deque[int] = deque()
        self._seq = 1  # the next queue (or outbox) row's store sequence number
        self._next_mid_hint = 1
        self._prefixes: dict[str, bytes] = {}  # client id -> its key prefix
        self._long_names: dict[bytes, str] = {}  # hashed key part -> the client id it stands for
        self.waiting_since = 0.0  # when the oldest batch still uncommitted was handed over

    def attach(self, loop: asyncio.AbstractEventLoop, on_callbacks_done: Callable[[], None] | None = None) -> None:
        """Bind to the event loop that records changes and runs ``when_durable`` callbacks."""
        self.loop = loop
        self.on_callbacks_done = on_callbacks_done

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
        """Run the callbacks of ``count`` committed batches. Clients whose changes were left out (``owners``) are
        reported first, so that their acknowledgements are not sent. When the write failed, run the batches'
        ``on_failure`` callbacks (with ``full``: whether for lack of room) instead: nothing that was not written is
        acknowledged."""
        if owners is not None and self.on_change_failed is not None:
            try:
                self.on_change_failed(self._owner_ids(owners))
            except Exception:
                log.exception("store: on_change_failed failed")
        ran = False
        for _ in range(count):
            if not self._inflight:
                break
            callbacks = self._inflight.popleft()
            failures = self._inflight_fail.popleft()
            seq = self._inflight_seq.popleft()
            if not ok:
                for fail in failures:
                    ran = True
                    try:
                        fail(full)
                    except Exception:
                        log.exception("durable failure callback failed")
                continue
            self.committed_seq = seq
            for cb in callbacks:
                ran = True
                try:
                    cb()
                except Exception:
                    log.exception("durable callback failed")
        if ran and self.on_callbacks_done is not None:
            self.on_callbacks_done()

    def _schedule(self) -> None:
        if self._submit_scheduled:
            return
        self._submit_scheduled = True
        loop = self.loop
        if loop is None:
            # No event loop (tools, unit tests): commit synchronously in the caller.
            self._submit_scheduled = False
            ops = self._take_ops()
            cbs, self._cbs = self._cbs, []
            fails, self._fails = self._fails, []
            ok = self._commit(ops)
            owners = self._take_skipped()
            if owners is not None and self.on_change_failed is not None:
                self.on_change_failed(self._owner_ids(owners))
            if ok:
                self.committed_seq = self._seq - 1
                for cb in cbs:
                    cb()
            else:
                for fail in fails:
                    fail(self.last_failure_full)
        elif self.settings.commit_interval > 0:
            loop.call_later(self.settings.commit_interval, self._submit)
        elif self._cbs or not self.settings.group_commit or not self.settings.lazy_commit:
            loop.call_soon(self._submit)
        else:
            # Nobody waits for these changes yet (deletes after acknowledgements, Packet Identifier updates,
            # QoS 0 queue rows): let them gather for a few milliseconds; a when_durable() brings the commit forward.
            self._lazy = loop.call_later(self.settings.lazy_commit, self._submit)

    def _submit(self) -> None:
        self._submit_scheduled = False
        if self._lazy is not None:
            self._lazy.cancel()
            self._lazy = None
        if not self._ops and not self._sent:
            if self._cbs:
                cbs, self._cbs = self._cbs, []
                self._fails = []
                for cb in cbs:
                    cb()
            return
        ops = self._take_ops()
        cbs, self._cbs = self._cbs, []
        if not self._inflight:
            self.waiting_since = time.monotonic()
        self._inflight.append(cbs)
        self._inflight_fail.append(self._fails)
        self._fails = []
        self._inflight_seq.append(self._seq - 1)
        self._queue.put((ops, self._next_mid_hint, self._seq))

    def _take_ops(self) -> list[tuple[Any, ...]]:
        """The open batch, with the row patches of the sends in it last (after any new row they patch)."""
        ops, self._ops = self._ops, []
        if self._sent:
            prefix, u64 = self._prefix, rec.u64
            ops.extend((_Q_SENT, prefix(cid) + u64(seq), d.packet_id, d.state) for seq, (cid, d) in self._sent.items())
            self._sent = {}
        return ops

    def _record(self, op: tuple[Any, ...]) -> None:
        self._ops.append(op)
        if not self._submit_scheduled:
            self._schedule()

    def _prefix(self, client_id: str) -> bytes:
        """The key prefix of ``client_id``'s rows (``records.client_prefix``), cached; a hashed one is remembered
        with its client id (to name the owner of a change that fails, :meth:`_owner_ids`)."""
        prefix = self._prefixes.get(client_id)
        if prefix is None:
            if len(self._prefixes) >= 10_000:
                self._prefixes.clear()
            prefix = self._prefixes[client_id] = rec.client_prefix(client_id)
            if len(prefix) > rec.NAME_MAX + 1:
                if len(self._long_names) >= 10_000:
                    self._long_names.clear()
                self._long_names[prefix[:-1]] = client_id
        return prefix

    def when_durable(self, callback: Callable[[], None], on_failure: Callable[[bool], None] | None = None) -> None:
        """Run ``callback`` on the loop once everything recorded so far is committed (FIFO with other callbacks);
        when the batch holding it cannot be committed, run ``on_failure`` instead (its argument: True when for
        lack of room, MDB_MAP_FULL/ENOSPC/EDQUOT), or nothing. A caller with no change of its own in that batch
        (nothing open, the batch handed over in an earlier loop turn) gets ``callback`` either way, after the
        batch's own failures: another client's failed commit does not refuse it."""
        if self._ops or self._cbs or self._sent:
            self._cbs.append(callback)
            if on_failure is not None:
                self._fails.append(on_failure)
            if not self.settings.group_commit:
                self._submit()
                if not self._submitted_this_turn and self.loop is not None:
                    self._submitted_this_turn = True
                    self.loop.call_soon(self._turn_over)
            elif self._lazy is not None:
                # Someone waits now: commit at the end of this loop turn, not when the lazy timer fires.
                self._lazy.cancel()
                self._lazy = None
                self._submit_scheduled = True
                assert self.loop is not None
                self.loop.call_soon(self._submit)
        elif self._inflight:
            self._inflight[-1].append(callback)  # FIFO: after the acknowledgements of the batch being written
            if self._submitted_this_turn:
                if on_failure is not None:
                    self._inflight_fail[-1].append(on_failure)
            else:
                # A rider: nothing is open, and every batch in flight was handed over in an earlier loop turn, so
                # none holds a change of this caller (a handler records and asks in one turn). If that batch
                # fails, this one has lost nothing: it completes after the batch's own failures, still in order,
                # and another client's failed commit never refuses it (isolation; DESIGN.md §4).
                self._inflight_fail[-1].append(lambda _full: callback())
        else:
            callback()

    def _turn_over(self) -> None:
        self._submitted_this_turn = False

    def pending(self) -> bool:
        """True while recorded changes or ``when_durable`` callbacks wait for a commit."""
        return bool(self._ops or self._cbs or self._sent or self._inflight)

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
            self._inflight.append(self._cbs)
            self._inflight_fail.append(self._fails)
            self._inflight_seq.append(self._seq - 1)
            self._cbs = []
            self._fails = []
            self._queue.put((ops, self._next_mid_hint, self._seq))
