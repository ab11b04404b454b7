"""A store is moved aside only when its data is damaged, never because of a bug in the code that reads it (`make
soak` once ran a half-edited broker whose store loader raised AttributeError; the store was quarantined and
11,401 acknowledged messages were lost)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.broker.message import Delivery, Message
from gateway.broker.session_state import Session
from gateway.store.lmdb_store import LmdbStore, StoreError, StoreSettings


def _store_with_a_message(path: Path) -> None:
    store = LmdbStore(StoreSettings(path=str(path)))
    store.load(0.0)
    session = Session("keeper", store.limits_for(), expiry_interval=3600)
    store.session_saved(session)
    store.delivery_saved("keeper", Delivery(Message(1, "t", b"kept", 1, False, {}, 0.0), 1))
    store.close()


def test_a_loader_bug_refuses_to_start_and_leaves_the_store_as_it_is(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "store"
    _store_with_a_message(path)

    def broken(self: LmdbStore, now: float, cleanup: bool = True) -> None:
        raise AttributeError("'LmdbStore' object has no attribute '_pagers'")

    monkeypatch.setattr(LmdbStore, "_read_all", broken)
    store = LmdbStore(StoreSettings(path=str(path)))
    with pytest.raises(StoreError, match="error in the broker, not in the store"):
        store.load(0.0)
    store.close()
    assert not list(tmp_path.glob("store.corrupt-*"))
    monkeypatch.undo()
    store = LmdbStore(StoreSettings(path=str(path)))
    state = store.load(0.0)
    assert [s.client_id for s in state.sessions] == ["keeper"]
    assert [d.message.payload for d in state.sessions[0].mqueue] == [b"kept"]
    store.close()


def test_damaged_data_is_still_quarantined(tmp_path: Path) -> None:
    path = tmp_path / "store"
    _store_with_a_message(path)
    data = path / "data.mdb"
    data.write_bytes(b"\x00" * 4096 + b"garbage" * 1000)
    store = LmdbStore(StoreSettings(path=str(path)))
    state = store.load(0.0)
    assert state.sessions == []
    assert store.quarantined and list(tmp_path.glob("store.corrupt-*"))
    store.close()
