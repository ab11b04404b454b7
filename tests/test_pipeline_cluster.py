"""The whole pipeline on a real Spark standalone cluster: a master and two workers started from
the installed pyspark's own launcher (``bin/spark-class``), on 127.0.0.1, each in its own temporary work directory;
``spark-submit --master spark://127.0.0.1:PORT pipeline/submit.py run all`` on the test landing area; every table
equal to the ``local[*]`` run's. The processes are stopped by PID.

It took 222 s on the shared 2-core machine (load average 7), over the 3 minutes `make test` allows it, so it runs
with `make test-cluster` (``FLEET_CLUSTER_TEST=1``) and is skipped otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
if not os.environ.get("FLEET_CLUSTER_TEST"):
    pytest.skip("runs with `make test-cluster` (FLEET_CLUSTER_TEST=1)", allow_module_level=True)

from pipeline_fixtures import ROOT, free_port, spark, wait_for
from pyspark.testing import assertDataFrameEqual
from test_pipeline_jobs import AS_OF, DAY, _build_landing

from pipeline import jobs
from pipeline import tables as tbl
from pipeline.schema import TABLES

__all__ = ["spark"]


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _env(work: Path) -> dict[str, str]:
    env = {**os.environ, "SPARK_HOME": str(_spark_home()), "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_LOG_DIR": str(work / "logs"), "SPARK_PID_DIR": str(work)}  # fmt: skip
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    env.pop("PYSPARK_GATEWAY_PORT", None)
    return env


class Daemon:
    """One standalone daemon (``spark-class <Master|Worker> ...``, which execs java: the PID is the JVM's)."""

    def __init__(self, name: str, args: list[str], work: Path) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.name, self.log = name, work / f"{name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([str(_spark_home() / "bin" / "spark-class"), *args], cwd=work,
                                         stdout=out, stderr=subprocess.STDOUT, env=_env(work))  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(``spark://127.0.0.1:PORT``, the root of the work dirs): a master and two workers (1 core, 1 GiB each),
    each in its own work dir."""
    root = tmp_path_factory.mktemp("standalone")
    port = free_port()
    daemons = [Daemon("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port",
                                 str(port), "--webui-port", str(free_port())], root / "master")]  # fmt: skip
    url = f"spark://127.0.0.1:{port}"
    try:
        wait_for(lambda: "I have been elected leader" in daemons[0].text() or daemons[0].proc.poll() is not None,
                 60, "the master")  # fmt: skip
        assert daemons[0].proc.poll() is None, daemons[0].text()
        for i in (1, 2):
            work = root / f"worker-{i}"
            daemons.append(Daemon(f"worker-{i}", ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                                                  "--cores", "1", "--memory", "1g", "--work-dir", str(work / "work"),
                                                  "--webui-port", str(free_port()), url], work))  # fmt: skip
        wait_for(lambda: daemons[0].text().count("Registering worker") >= 2, 60, "two workers registered")
        yield url, root
    finally:
        for d in reversed(daemons):
            d.stop()
        assert all(d.proc.poll() is not None for d in daemons)


@pytest.mark.timeout(300)
def test_spark_submit_on_a_standalone_cluster_gives_the_local_tables(
    spark: Any, cluster: tuple[str, Path], tmp_path: Path
) -> None:
    """`spark-submit --master spark://...` of `run all` (client mode: the driver here, executors on the two
    workers, tables on the disk they share) writes every table exactly as the local run does."""
    _build_landing(tmp_path / "landing")
    local = jobs.run(spark, jobs.JobConfig(landing=str(tmp_path / "landing"), tables=str(tmp_path / "local"),
                                           as_of=AS_OF), "all", DAY, DAY)  # fmt: skip
    url, root = cluster
    proc = subprocess.run(
        [str(_spark_home() / "bin" / "spark-submit"), "--master", url, "--deploy-mode", "client",
         "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
         "--conf", "spark.ui.enabled=false", "--conf", "spark.executor.memory=512m", "--conf", "spark.executor.cores=1",
         "--conf", "spark.cores.max=2", "--conf", "spark.sql.shuffle.partitions=4",
         str(ROOT / "pipeline" / "submit.py"), "--log-level", "warning", "run", "all",
         "--from", DAY.isoformat(), "--to", DAY.isoformat(), "--as-of", AS_OF.isoformat(),
         "--landing", str(tmp_path / "landing"), "--tables", str(tmp_path / "cluster")],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=_env(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["spark"] == {"spark.master": url, "spark.sql.shuffle.partitions": "4"}
    assert {k: v for k, v in result.items() if k not in ("stage", "from", "to", "spark")} == local
    # the executors ran on both workers: each has the application's directory (executor logs) in its work dir
    for i in (1, 2):
        assert list((root / f"worker-{i}" / "work").glob("app-*/*/stderr")), f"worker-{i} ran no executor"
    for name in TABLES:
        got = tbl.read_table(spark, str(tmp_path / "cluster"), name, DAY, DAY)
        want = tbl.read_table(spark, str(tmp_path / "local"), name, DAY, DAY)
        assert want.count() > 0, name
        assertDataFrameEqual(got, want)
