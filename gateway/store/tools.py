"""``edge-gateway store stats|inspect|compact``: look into and compact the LMDB store while the broker is
stopped (the store's lock file keeps a running broker and these tools apart).

On a terminal they show progress on stderr while they read or copy the store (tqdm: rows done of all rows, bytes,
rows per second, time left); they stay quiet when stderr is not a terminal (scripts, pipes, files) and under
systemd (``INVOCATION_ID`` or ``JOURNAL_STREAM`` set), so their output stays the same for scripts.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import lmdb

from gateway.broker.store_port import LoadedState
from gateway.store.lmdb_store import LmdbStore, StoreSettings
from gateway.store.loading import LoadProgress
from gateway.store.tables import DB_NAMES


def show_progress(stream: TextIO | None = None, env: Mapping[str, str] = os.environ) -> bool:
    """Whether to draw progress on ``stream`` (stderr): it is a terminal and this is not a systemd service
    (``INVOCATION_ID`` or ``JOURNAL_STREAM`` set: the journal is no terminal, whatever a pty says)."""
    stream = sys.stderr if stream is None else stream
    if env.get("INVOCATION_ID") or env.get("JOURNAL_STREAM"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _NoBar:
    """What :func:`_bar` gives when no progress is shown: counts, draws nothing (and tqdm is not imported)."""

    disable = True

    def __init__(self) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def _size(n: int) -> str:
    """``n`` bytes as tqdm shows sizes (1024-based: "3.5MB")."""
    from tqdm import tqdm

    return str(tqdm.format_sizeof(n, "B", 1024))


def _bar(total: int, desc: str, stream: TextIO | None) -> Any:
    """A tqdm bar of ``total`` rows on ``stream`` (stderr), or a :class:`_NoBar` when :func:`show_progress` says
    no (tqdm is imported only for a terminal: it takes a noticeable part of a short command's start)."""
    stream = sys.stderr if stream is None else stream
    if not show_progress(stream):
        return _NoBar()
    from tqdm import tqdm

    # the terminal's size (COLUMNS/LINES, else the terminal's, else 100x24 when it reports 0x0 as a fresh pty
    # does: tqdm would then draw nothing)
    size = shutil.get_terminal_size((100, 24))
    return tqdm(total=total, desc=desc, unit=" rows", unit_scale=True, file=stream, ncols=size.columns,
                nrows=size.lines, mininterval=0.2)


class LoadBar:
    """The store's ``on_load_progress`` callback as a tqdm bar: rows read of all rows, bytes read, rate, ETA."""

    def __init__(self, desc: str, stream: TextIO | None = None) -> None:
        self.desc = desc
        self.stream = stream
        self.bar: Any = None

    def __call__(self, progress: LoadProgress) -> None:
        if self.bar is None:
            self.bar = _bar(progress.rows_total, self.desc, self.stream)
        bar = self.bar
        bar.update(progress.rows_read - bar.n)
        if not bar.disable:
            table = progress.table or "-"
            bar.set_postfix_str(f"{_size(progress.bytes_read)} read, table {table}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _open(settings: StoreSettings, desc: str = "reading store") -> tuple[LmdbStore, LoadedState]:
    if not (Path(settings.path) / "data.mdb").exists():
        raise FileNotFoundError(f"no store at {settings.path} (data.mdb missing)")
    store = LmdbStore(StoreSettings(settings.path, settings.max_size, 0, "refuse"))
    bar = LoadBar(desc)
    store.on_load_progress = bar
    try:
        state = store.load(time.time(), cleanup=False)  # look, do not change
    except BaseException:
        store.close()
        raise
    finally:
        bar.close()
    return store, state


def stats(settings: StoreSettings, out: TextIO = sys.stdout, as_json: bool = False) -> int:
    """Print sizes, session count, queue depths and the oldest queued message's age. Returns an exit code."""
    store, _state = _open(settings)
    try:
        info = store.stats(time.time())
    finally:
        store.close()
    if as_json:
        json.dump(info, out, indent=2, sort_keys=True)
        out.write("\n")
        return 0
    age = info["oldest_message_age"]
    out.write(f"store            {info['path']}\n")
    out.write(f"data file        {info['file_size']} bytes (map {info['map_size']}, max_size {info['max_size']})\n")
    out.write(f"used             {info['used_bytes']} bytes\n")
    out.write(f"sessions         {info['sessions']}\n")
    out.write(f"messages         {info['messages_entries']} stored payloads shared by reference, "
              f"{info['inline_messages']} stored in their queue row\n")
    out.write(f"queued           {info['queue_entries']} deliveries\n")
    out.write(f"inbound QoS 2    {info['inbound_entries']} awaiting PUBREL\n")
    out.write(f"retained         {info['retained_entries']}\n")
    out.write(f"upstream outbox  {info.get('outbox_entries', 0)} awaiting the cloud broker's acknowledgement\n")
    out.write(f"oldest message   {'-' if age is None else f'{age:.1f} s'}\n")
    for cid, depth in sorted(info["queue_depths"].items(), key=lambda kv: -kv[1])[:20]:
        out.write(f"  queue {cid!r}: {depth}\n")
    return 0


def inspect(settings: StoreSettings, out: TextIO = sys.stdout) -> int:
    """Print every persistent session (expiry, subscriptions, queue depth, inflight) and retained topic."""
    store, state = _open(settings)
    store.close()
    now = time.time()
    for s in sorted(state.sessions, key=lambda x: x.client_id):
        expires = "when it reconnects + expiry" if s.expires_at is None else f"in {s.expires_at - now:.0f} s"
        out.write(f"session {s.client_id!r}: MQTT level {s.protocol_level}, expiry {s.expiry_interval:.0f} s, "
                  f"ends {expires}\n")
        for key, r in sorted(s.subscriptions.items()):
            out.write(f"  subscription {key!r} qos={r.qos} no_local={r.no_local} rap={r.retain_as_published} "
                      f"rh={r.retain_handling} id={r.sub_id}\n")
        out.write(f"  queued {len(s.mqueue)}, in flight {len(s.inflight)}, inbound QoS 2 {len(s.awaiting_rel)}\n")
        if s.will is not None:
            out.write(f"  delayed will to {s.will.topic!r} due at {s.will_at}\n")
    for m in sorted(state.retained, key=lambda x: x.topic):
        out.write(f"retained {m.topic!r}: {len(m.payload)} bytes, QoS {m.qos}\n")
    return 0


def _has_db(env: lmdb.Environment, name: str) -> bool:
    with env.begin() as txn:
        return txn.get(name.encode()) is not None  # named databases are keys of the main database


def _advance(bar: Any, rows: int, copied: int, table: str) -> None:
    bar.update(rows)
    if not bar.disable:
        bar.set_postfix_str(f"{_size(copied)} copied, table {table}", refresh=False)


def compact(settings: StoreSettings, out: TextIO = sys.stderr) -> int:
    """Copy every entry into a fresh environment and swap it in only when complete; progress (rows, bytes, rate,
    time left) on stderr when it is a terminal (:func:`show_progress`).

    The old environment is kept as ``<path>.old`` until the swap succeeded, then removed.
    """
    src = Path(settings.path)
    if not (src / "data.mdb").exists():
        raise FileNotFoundError(f"no store at {src} (data.mdb missing)")
    lock = LmdbStore(StoreSettings(str(src)))
    lock._take_lock()  # refuse while a broker runs on this store
    tmp = src.with_name(f"{src.name}.compact-tmp")
    old = src.with_name(f"{src.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        before = (src / "data.mdb").stat().st_size
        env = lmdb.open(str(src), readonly=True, max_dbs=len(DB_NAMES) + 1, lock=False)
        dst = lmdb.open(str(tmp), map_size=max(env.info()["map_size"], 1 << 20), max_dbs=len(DB_NAMES) + 1)
        try:
            names = [n for n in DB_NAMES if _has_db(env, n)]  # a store written before "outbox" existed lacks it
            dbs = [env.open_db(n.encode(), create=False) for n in names]
            with env.begin() as txn:
                total = sum(txn.stat(db)["entries"] for db in dbs)
            copied = 0
            bar = _bar(total, "compacting", sys.stderr)
            for name, db in zip(names, dbs, strict=True):
                ddb = dst.open_db(name.encode())
                with env.begin(db=db) as rtxn:
                    cursor = rtxn.cursor()
                    batch: list[tuple[bytes, bytes]] = []
                    for key, value in cursor:
                        batch.append((bytes(key), bytes(value)))
                        copied += len(key) + len(value)
                        if len(batch) >= 5000:
                            with dst.begin(write=True, db=ddb) as wtxn:
                                wtxn.cursor().putmulti(batch, append=True)
                            _advance(bar, len(batch), copied, name)
                            batch = []
                    if batch:
                        with dst.begin(write=True, db=ddb) as wtxn:
                            wtxn.cursor().putmulti(batch, append=True)
                        _advance(bar, len(batch), copied, name)
            bar.close()
            dst.sync(True)
        finally:
            dst.close()
            env.close()
        if old.exists():
            shutil.rmtree(old)
        os.replace(src, old)
        os.replace(tmp, src)
        shutil.rmtree(old, ignore_errors=True)
        after = (src / "data.mdb").stat().st_size
        out.write(f"compacted {src}: {before} -> {after} bytes ({total} entries)\n")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        lock.close()
