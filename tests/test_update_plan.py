"""gateway/update/plan.py in process: the manifest, the install decision, the rollback records, the maintenance
window with the time passed in, and the free-space rule (README "Pull updates")."""

from __future__ import annotations

import datetime
import json

import pytest

from gateway.update.plan import (
    Action,
    Manifest,
    ManifestError,
    Pending,
    Window,
    compare_versions,
    decide,
    parse_manifest,
    pending_outcome,
    rolled_back_version,
    space_needed,
)

URL = "https://updates.example.net/eg/stable.json"
GOOD = {"version": "1.5.0", "compatible": "edge-gateway-amd64", "url": "b/x.raucb", "sha256": "AB" * 32, "size": 10}


def manifest(**over: object) -> bytes:
    return json.dumps({**GOOD, **over}).encode()


def test_manifest_relative_url_resolves_against_the_manifest_and_sha_is_lower_case() -> None:
    m = parse_manifest(manifest(), URL, 100)
    assert m == Manifest("1.5.0", "edge-gateway-amd64", "https://updates.example.net/eg/b/x.raucb", "ab" * 32, 10)
    assert m.bundle_name == "ab" * 32 + ".raucb"
    assert parse_manifest(manifest(url="https://cdn.example/y.raucb"), URL, 100).url == "https://cdn.example/y.raucb"


@pytest.mark.parametrize(("data", "error"), [
    (b"{", "not JSON"),
    (b"[]", "must be a JSON object, not list"),
    (json.dumps({"version": "1"}).encode(), "missing compatible, url, sha256, size"),
    (manifest(version="../1"), "version = '../1': must be 1 to 64 letters"),
    (manifest(url="http://x.example/a.raucb"), "url = 'http://x.example/a.raucb': must resolve to an https:// URL"),
    (manifest(sha256="abc"), "sha256 = 'abc': must be the bundle's SHA-256 as 64 hex digits"),
    (manifest(size=0), "size = 0: must be the bundle's size in bytes, an integer > 0"),
    (manifest(size=True), "size = True: must be"),
    (manifest(size=101), "size = 101: more than [update] max_bundle_size (100 bytes)"),
])
def test_bad_manifests_name_the_field(data: bytes, error: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(data, URL, 100)
    assert error in str(info.value)


@pytest.mark.parametrize(("a", "b", "order"), [
    ("1.10", "1.9", 1), ("1.2", "1.2.1", -1), ("2026.5.1", "2026.11.1", -1), ("1.4.2", "1.4.2", 0),
    ("1.0-2", "1.0-10", -1), ("1.2", "1.02", 1),
])
def test_versions_compare_numbers_numerically(a: str, b: str, order: int) -> None:
    assert compare_versions(a, b) == order
    assert compare_versions(b, a) == -order


def test_decide_in_order_compatible_same_rejected_older_install() -> None:
    m = parse_manifest(manifest(), URL, 100)
    none: frozenset[str] = frozenset()
    assert decide(m, "edge-gateway-arm64", "1.4.0", none).action is Action.OTHER_COMPATIBLE
    assert decide(m, "edge-gateway-amd64", "1.5.0", none).action is Action.UP_TO_DATE
    assert decide(m, "edge-gateway-amd64", "1.4.0", frozenset({"1.5.0"})).action is Action.REJECTED
    assert decide(m, "edge-gateway-amd64", "1.6.0", none).action is Action.OLDER
    assert decide(m, "edge-gateway-amd64", "1.4.0", none).action is Action.INSTALL
    assert decide(m, "edge-gateway-amd64", None, none).reason == "version 1.5.0 is available (installed: unknown)"


def test_rollback_records() -> None:
    assert rolled_back_version('OUTCOME="rolled_back"\nPREVIOUS=1.5.0\n') == "1.5.0"
    assert rolled_back_version("OUTCOME=good\nPREVIOUS=1.5.0\n") is None
    assert rolled_back_version("OUTCOME=rolled_back\nPREVIOUS=../etc\n") is None  # never a path
    pending = Pending.load(Pending("1.5.0", "boot-a").dump())
    assert pending == Pending("1.5.0", "boot-a")
    assert pending_outcome(pending, "1.5.0", "boot-b") == "booted"
    assert pending_outcome(pending, "1.4.2", "boot-b") == "rolled_back"
    assert pending_outcome(pending, "1.4.2", "boot-a") == "awaiting_reboot"
    assert Pending.load("VERSION=1.5.0\n") is None


def at(hh: int, mm: int, day: int = 1) -> datetime.datetime:
    return datetime.datetime(2026, 5, day, hh, mm)


def test_window_contains_start_not_end_and_crosses_midnight() -> None:
    w = Window.parse("02:00-04:00")
    assert (w.contains(at(2, 0)), w.contains(at(3, 59)), w.contains(at(4, 0)), w.contains(at(1, 59))) == (
        True, True, False, False)
    night = Window.parse("23:00-01:00")
    assert night.minutes == 120 and str(night) == "23:00-01:00"
    assert (night.contains(at(23, 0)), night.contains(at(0, 30)), night.contains(at(1, 0))) == (True, True, False)
    assert night.contains(at(22, 59)) is False


def test_window_next_opening_today_or_tomorrow() -> None:
    w = Window.parse("02:00-04:00")
    assert w.next_opening(at(1, 0)) == at(2, 0)
    assert w.next_opening(at(2, 0)) == at(2, 0, day=2)  # already open: the next one
    assert w.next_opening(at(12, 30)) == at(2, 0, day=2)


@pytest.mark.parametrize("value", ["2-4", "02:00", "24:00-01:00", "02:60-03:00", "02:00-02:00", 2])
def test_window_bad_values(value: object) -> None:
    with pytest.raises(ValueError, match='must be two local times "HH:MM-HH:MM"'):
        Window.parse(value)


def test_space_needed_counts_the_download_the_store_room_and_the_reserve() -> None:
    mib = 1024**2
    assert space_needed(100 * mib, 1024 * mib, 300 * mib, 64 * mib, True) == (100 + 724 + 64) * mib
    assert space_needed(100 * mib, 1024 * mib, 300 * mib, 64 * mib, False) == (100 + 64) * mib  # store elsewhere
    assert space_needed(0, 1024 * mib, 2048 * mib, 0, True) == 0  # a store past max_size has no room left to claim
