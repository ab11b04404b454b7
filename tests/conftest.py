"""Shared fixtures: a real broker subprocess per test module (and per test where a config is needed)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

import pytest
from helpers import STARTED, BrokerProcess

from gateway import native

_ids = itertools.count()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--core",
        choices=("any", "compiled", "pure"),
        default="any",
        help="fail at once unless the MQTT codec and the broker core run this way: compiled (mypyc) or pure (their "
        ".py files; EDGE_GATEWAY_PURE=1). make test runs the suite with --core compiled and the codec and core tests "
        "with --core pure.",
    )


def pytest_configure(config: pytest.Config) -> None:
    wanted = config.getoption("--core")
    core = native.select()
    if wanted != "any" and core.compiled != (wanted == "compiled"):
        raise pytest.UsageError(f"--core {wanted}, but the MQTT codec and broker core run {core.describe()}")


def pytest_report_header(config: pytest.Config) -> str:
    return f"edge-gateway MQTT codec and broker core: {native.select().describe()}"


_first_broker = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Remember which brokers this test starts; forget the module's brokers after its last test."""
    item.stash[_first_broker] = len(STARTED)
    yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        del STARTED[:]  # the module's brokers are stopped: forget them


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing test's report ends with the last lines of each broker it started or that still runs (a module
    fixture's): a failure seen only on a loaded CI machine can then be read from the CI log."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call":
        first = item.stash.get(_first_broker, 0)
        for i, proc in enumerate(STARTED):
            if i >= first or (proc.proc is not None and proc.proc.poll() is None):
                report.sections.append((f"broker {i} log (last 150 lines)", "\n".join(proc.lines[-150:])))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker for the module on 127.0.0.1 with an ephemeral port and short timers."""
    config = """
[broker]
sys_interval = "1s"
[listeners.external]
bind = "127.0.0.1:0"
"""
    proc = BrokerProcess(config, workdir=str(tmp_path_factory.mktemp("broker"))).start()
    yield proc
    code = proc.stop()
    assert code == 0, proc.log()


@pytest.fixture
def make_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., BrokerProcess]]:
    """Start brokers with a given TOML config (``bind`` must use port 0); all are stopped at the end."""
    started: list[BrokerProcess] = []

    def make(config: str) -> BrokerProcess:
        proc = BrokerProcess(config, workdir=str(tmp_path_factory.mktemp("broker"))).start()
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()


@pytest.fixture
def uid(request: pytest.FixtureRequest) -> str:
    """A unique prefix for client ids and topics of one test."""
    return f"{request.node.name[:40]}-{os.getpid()}-{next(_ids)}"
