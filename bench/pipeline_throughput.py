"""Fleet pipeline throughput: landed records per second through every batch job on the embedded ``local[*]``.

Lands N records (default 10^6) as the lander would (JSON lines by arrival date and gateway, one file per gateway
and hour): 50 gateways per 10^6 records x 4 devices, one reading every 15 s for a day, one reboot per device, and
the faults the pipeline exists for: ~2% duplicates (QoS 1 redelivery), ~0.5% lost readings, ~0.1% sensor clocks
far off, ~0.1% malformed payloads, arrivals shuffled within each file. Then times ``fleet-pipeline run all`` for
that day (clean, dedup, windows, completeness, latency; Parquet out) twice: the first run includes the JVM's
warm-up, the second is an idempotent rebuild of the same partitions.

    .venv/bin/python bench/pipeline_throughput.py [--records 1000000] [--workdir DIR] [--keep]

Not a test: reads and writes only under its work directory (a temporary one by default) and stops by itself.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: another tree's pipeline/ can be measured

DAY = dt.date(2024, 5, 1)
GATEWAYS = 50
DEVICES = 4
PERIOD = 15.0  # seconds between readings of one device


def _iso(t: float, ms: bool = True) -> str:
    """RFC 3339 UTC with milliseconds (``ms``) or microseconds: plain string formatting, no datetime objects."""
    whole = int(t)
    frac = t - whole
    text = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(whole))
    return text + (f"{min(999, int(frac * 1000)):03d}Z" if ms else f"{min(999_999, int(frac * 1_000_000)):06d}Z")


def _gateway(job: tuple[int, int, int, float, int, tuple[float, float] | None, dict[int, tuple[float, float]],
                        str]) -> dict[str, int]:
    """One gateway's landing files (its own random stream, so gateways are written in parallel processes)."""
    g, seed, per_device, day0, landing_format, gw_window, dev_windows, landing = job
    rng = random.Random(f"{seed}:{g}")
    counts = dict.fromkeys(("lines", "readings", "duplicates", "lost", "malformed", "malformed_lines", "clamped"), 0)
    gw = f"gw-{g:04d}"
    hours: dict[int, list[str]] = {}
    for d in range(DEVICES):
        dev = f"buoy-{g:04d}-{d}"
        head = f'{{"topic":"fleet/{gw}/{dev}","arrival":"'
        reboot_at = rng.randrange(per_device // 4, 3 * per_device // 4)
        windows = [w for w in (gw_window, dev_windows.get(d)) if w]
        for i in range(per_device):
            boot, seq = (7, i) if i < reboot_at else (8, i - reboot_at)
            gt = day0 + 5 + i * PERIOD + rng.random()
            if rng.random() < 0.005 or any(w[0] <= gt - day0 < w[1] for w in windows):
                counts["lost"] += 1
                continue
            st = gt - 0.2 - rng.random() * 0.3
            if rng.random() < 0.001:
                st = st - 86400 * 365  # a board whose clock reset
                counts["clamped"] += 1
            sst = 12.0 + 3.0 * ((i % 5760) / 5760.0) + rng.gauss(0, 0.05)
            payload = (
                f'{{"v":1,"gateway_id":"{gw}","device":"{dev}","boot":{boot},"seq":{seq},'
                f'"sensor_time":"{_iso(st)}","gateway_time":"{_iso(gt)}",'
                f'"values":{{"sea_surface_temperature":{{"value":{sst:.3f},"unit":"degC"}},'
                f'"battery_voltage":{{"value":{3.9 - i / per_device * 0.4:.3f},"unit":"V"}}}}}}'
            )
            if rng.random() < 0.001:
                payload = payload[: len(payload) // 2]  # truncated: malformed
                counts["malformed"] += 1
                counts["malformed_lines"] += 1
            else:
                counts["readings"] += 1
            copies = 2 if rng.random() < 0.02 else 1
            counts["malformed_lines" if payload[-1] != "}" else "duplicates"] += copies - 1
            # as pipeline.lander.encode_line writes it: format 2 embeds a JSON object payload as the object (last
            # key); a truncated one, and every payload in format 1, is a JSON string (no escapes needed but '"')
            embedded = landing_format == 2 and payload[-1] == "}"
            body = payload if embedded else json.dumps(payload, ensure_ascii=False)
            for c in range(copies):
                arrival = gt + 0.5 + rng.random() + c * rng.uniform(1, 120)
                line = f'{head}{_iso(arrival, ms=False)}","msg_id":"{gw}:{i}","qos":1,"retain":false,"payload":{body}}}'
                hours.setdefault(min(23, int((arrival - day0) // 3600)), []).append(line)
                counts["lines"] += 1
    for hour, lines in hours.items():
        rng.shuffle(lines)
        part = Path(landing) / f"date={DAY.isoformat()}" / f"gateway={gw}"
        part.mkdir(parents=True, exist_ok=True)
        (part / f"part-{DAY:%Y%m%d}T{hour:02d}0000Z-bench-{g:04d}.jsonl").write_text("\n".join(lines) + "\n")
    return counts


def generate(landing: Path, records: int, seed: int = 8, outages: int = 0, landing_format: int = 2,
             gateways: int | None = None, processes: int | None = None) -> dict[str, int]:
    """Write about ``records`` landing lines; returns what was put in (lines, readings, duplicates, ...).
    ``landing_format``: 2 (the lander's: a JSON object payload embedded) or 1 (every payload a JSON string).
    ``outages``: that many gateways lose every reading for 20-120 minutes, and as many devices for 15-90 (for the
    report's outage timeline; 0 for the throughput figures). ``gateways`` (default ``GATEWAYS``) x 4 devices share
    the records; each gateway is written by one of ``processes`` worker processes (default: one per core)."""
    gateways = gateways or GATEWAYS
    rng = random.Random(seed)
    day0 = dt.datetime(DAY.year, DAY.month, DAY.day, tzinfo=dt.UTC).timestamp()
    per_device = max(1, round(records / (0.995 * 1.02) / (gateways * DEVICES)))  # 0.5% lost, 2% sent twice
    span = per_device * PERIOD
    gw_out = {g: (t := rng.uniform(0, span * 0.8), t + rng.uniform(1200, 7200)) for g in rng.sample(range(gateways),
                                                                                            min(outages, gateways))}
    dev_out: dict[int, dict[int, tuple[float, float]]] = {}
    for g, d in rng.sample([(g, d) for g in range(gateways) for d in range(DEVICES)], min(outages, gateways * DEVICES)):
        dev_out.setdefault(g, {})[d] = (t := rng.uniform(0, span * 0.8), t + rng.uniform(900, 5400))
    jobs = [(g, seed, per_device, day0, landing_format, gw_out.get(g), dev_out.get(g, {}), str(landing))
            for g in range(gateways)]
    counts = dict.fromkeys(("lines", "readings", "duplicates", "lost", "malformed", "malformed_lines", "clamped"), 0)
    with multiprocessing.get_context("fork").Pool(processes or os.cpu_count() or 1) as pool:
        for part in pool.imap_unordered(_gateway, jobs):
            for key, value in part.items():
                counts[key] += value
    return counts


class StageMetrics:
    """Task metrics of the Spark stages each pipeline stage ran, from the session's own UI REST API (bound to
    127.0.0.1 like the rest of the embedded session): tasks, executor run time, executor CPU time, JVM GC time,
    input bytes, shuffle writes and spills, summed per pipeline stage, and the costliest Spark stages."""

    def __init__(self, spark: Any) -> None:
        self.sc = spark.sparkContext
        self.url = f"{self.sc.uiWebUrl}/api/v1/applications/{self.sc.applicationId}"
        self.seen: set[int] = set()

    def _get(self, what: str) -> Any:
        with urllib.request.urlopen(f"{self.url}/{what}", timeout=30) as response:
            return json.load(response)

    def take(self, threads: dict[str, float] | None = None) -> dict[str, Any]:
        """The Spark stages completed since the last call, summed (the listener bus is asynchronous: wait until
        no stage is active)."""
        for _ in range(50):
            if not self._get("stages?status=active"):
                break
            time.sleep(0.2)
        time.sleep(0.5)
        new = [st for st in self._get("stages?status=complete") if st["stageId"] not in self.seen]
        self.seen.update(st["stageId"] for st in new)
        keys = {"numTasks": "tasks", "executorRunTime": "run_s", "executorCpuTime": "cpu_s", "jvmGcTime": "gc_s",
                "inputBytes": "input_mb", "shuffleWriteBytes": "shuffle_write_mb",
                "memoryBytesSpilled": "spill_memory_mb", "diskBytesSpilled": "spill_disk_mb"}
        scale = {"tasks": 1, "run_s": 1e3, "cpu_s": 1e9, "gc_s": 1e3, "input_mb": 1e6, "shuffle_write_mb": 1e6,
                 "spill_memory_mb": 1e6, "spill_disk_mb": 1e6}
        total = {name: round(sum(st.get(key, 0) for st in new) / scale[name], 1) for key, name in keys.items()}
        total["spark_stages"] = len(new)
        if threads:
            total["jvm_threads_cpu_s"] = {k: round(v, 1) for k, v in threads.items()}
        top = sorted(new, key=lambda st: -st.get("executorRunTime", 0))[:4]
        total["top"] = [f"{st['stageId']} {st['name']} ({st['numTasks']} tasks): run "
                        f"{st['executorRunTime'] / 1e3:.1f}s cpu {st['executorCpuTime'] / 1e9:.1f}s "
                        f"gc {st['jvmGcTime'] / 1e3:.1f}s" for st in top]
        return total


THREAD_KINDS = (("Executor task", "tasks"), ("C1 Compiler", "jit"), ("C2 Compiler", "jit"), ("GC Thread", "gc"),
                ("G1 ", "gc"), ("VM Thread", "gc"))


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a JVM's live threads by kind: Spark's task threads, the JIT compilers, the garbage collector,
    and the rest (the driver: planning, codegen, py4j; the listener bus...); ``total`` counts exited threads too."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {"tasks": 0.0, "jit": 0.0, "gc": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        kind = next((k for prefix, k in THREAD_KINDS if name.startswith(prefix)), "other")
        out[kind] += (int(fields[11]) + int(fields[12])) / ticks
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    out["total"] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--workdir")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--gateways", type=int,
                        help="gateways (4 devices each; default 50 per 10^6 records, so a device's ~5,000 readings "
                             "at 15 s fit in the day)")
    parser.add_argument("--outages", type=int, default=0, help="gateways and devices with an outage (default 0)")
    parser.add_argument("--report", help="also write the fleet report of the result to this HTML file")
    parser.add_argument("--landing-format", type=int, choices=[1, 2], default=2,
                        help="2: the lander's (JSON object payloads embedded; default); 1: every payload a string")
    parser.add_argument("--runs", type=int, choices=[1, 2], default=2, help="1: the first run only (no rebuild)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep an existing landing area in --workdir (same --records) instead of generating it")
    parser.add_argument("--profile", action="store_true",
                        help="per stage: tasks, executor run/CPU/GC time, spills (Spark UI REST API on 127.0.0.1), "
                             "and a GC log of the JVM in the work directory")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="a Spark setting")
    args = parser.parse_args()

    import pipeline
    from pipeline import jobs
    from pipeline import spark as pipeline_spark
    from pipeline.spark import get_spark

    print(f"pipeline: {Path(pipeline.__file__).parent}")  # PYTHONPATH=OTHER_TREE measures another tree's pipeline/
    local_submit_args = getattr(pipeline_spark, "local_submit_args", None)
    if local_submit_args is None:  # a pipeline/ from before local_submit_args (and its collector setting)
        def local_submit_args(conf: dict[str, str], java_options: str = "") -> str:
            memory = conf.get("spark.driver.memory", getattr(pipeline_spark, "LOCAL_DRIVER_MEMORY", "2g"))
            options = " ".join(filter(None, [conf.get("spark.driver.extraJavaOptions", ""), java_options]))
            return f"--driver-memory {memory} --driver-java-options {shlex.quote(options)} pyspark-shell"

    gateways = args.gateways or max(GATEWAYS, -(-args.records // 20_000))

    work = Path(args.workdir or tempfile.mkdtemp(prefix="fleet-bench-"))
    landing, tables = work / "landing", work / "tables"
    counts_file = work / "landing-counts.json"
    reuse = (args.reuse and counts_file.exists() and landing.is_dir()
             and json.loads(counts_file.read_text()).get("landing_format") == args.landing_format
             and json.loads(counts_file.read_text()).get("gateways", GATEWAYS) == gateways)
    if not reuse:
        shutil.rmtree(landing, ignore_errors=True)
    shutil.rmtree(tables, ignore_errors=True)
    try:
        t0 = time.monotonic()
        if reuse:
            counts = json.loads(counts_file.read_text())
        else:
            counts = generate(landing, args.records, outages=args.outages, landing_format=args.landing_format,
                              gateways=gateways)
            counts["landing_format"] = args.landing_format
            counts["gateways"] = gateways
            counts_file.write_text(json.dumps(counts))
        gen_s = time.monotonic() - t0
        size = sum(p.stat().st_size for p in landing.rglob("*.jsonl"))
        files = sum(1 for _ in landing.rglob("*.jsonl"))
        print(f"landed {counts['lines']:,} lines ({size / 1e6:.0f} MB, {files} files) in {gen_s:.1f}s: {counts}")
        t0 = time.monotonic()
        conf_args = dict(pair.split("=", 1) for pair in args.conf)
        if args.profile:
            conf_args.setdefault("spark.ui.enabled", "true")
            if "PYSPARK_SUBMIT_ARGS" not in os.environ:
                os.environ["PYSPARK_SUBMIT_ARGS"] = local_submit_args(conf_args, f"-Xlog:gc:file={work / 'gc.log'}")
        spark = get_spark("fleet-pipeline bench", conf_args)
        metrics = StageMetrics(spark) if args.profile else None
        start_s = time.monotonic() - t0
        conf = spark.sparkContext.getConf()
        print(f"spark {spark.version} {conf.get('spark.master')} ({os.cpu_count()} cores), shuffle partitions "
              f"{spark.conf.get('spark.sql.shuffle.partitions')}, started in {start_s:.1f}s")
        jvm = spark.sparkContext._gateway.proc.pid  # the JVM that runs local[*] (spark-submit execs java)
        ticks = os.sysconf("SC_CLK_TCK")

        def jvm_cpu() -> float:
            """CPU seconds (user + system) of the Spark JVM so far: less sensitive than wall time to other load."""
            fields = Path(f"/proc/{jvm}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / ticks

        cfg = jobs.JobConfig(landing=str(landing), tables=str(tables), as_of=dt.datetime(2024, 5, 3, tzinfo=dt.UTC))
        runs = []
        for label in ("first run", "rebuild")[: 1 if args.report else args.runs]:
            stages: dict[str, float] = {}
            stats: dict[str, int] = {}
            cpu: dict[str, float] = {}
            profile: dict[str, Any] = {}
            threads_mark = thread_cpu(jvm)
            t_all = mark = time.monotonic()
            cpu_all = cpu_mark = jvm_cpu()

            def stage_done(stage: str, stages: dict[str, float] = stages, cpu: dict[str, float] = cpu,
                           profile: dict[str, Any] = profile, threads_mark: dict[str, float] = threads_mark) -> None:
                nonlocal mark, cpu_mark
                now, now_cpu = time.monotonic(), jvm_cpu()
                stages[stage], cpu[stage] = round(now - mark, 2), round(now_cpu - cpu_mark, 2)
                mark, cpu_mark = now, now_cpu
                print(f"  {stage}: {stages[stage]:.1f}s, JVM CPU {cpu[stage]:.1f}s", flush=True)
                if metrics is not None:
                    profile[stage] = metrics.take({k: v - threads_mark[k] for k, v in thread_cpu(jvm).items()})
                    print(f"    {profile[stage]}", flush=True)
                    # the REST calls are not the stage's cost
                    mark, cpu_mark, _ = time.monotonic(), jvm_cpu(), threads_mark.update(thread_cpu(jvm))

            if hasattr(jobs, "run_all"):
                stats.update(jobs.run_all(spark, cfg, DAY, DAY, on_stage=stage_done))
            else:  # the jobs before the parse-once change (to measure a baseline with this script)
                for stage in jobs.STAGES:
                    counts_of_stage = jobs.RUNNERS[stage](spark, cfg, DAY, DAY)
                    stage_done(stage)
                    if not hasattr(jobs, "stats"):  # before jobs.stats: each runner counted its rows itself
                        stats.update(counts_of_stage)
                if hasattr(jobs, "stats"):
                    stats.update(jobs.stats(spark, cfg, list(jobs.STAGES), DAY, DAY))
                stage_done("stats")
            elapsed = time.monotonic() - t_all
            cpu_s = jvm_cpu() - cpu_all
            rate = counts["lines"] / elapsed
            runs.append({"run": label, "seconds": round(elapsed, 2), "records_per_s": round(rate), "stages": stages,
                         "jvm_cpu_s": round(cpu_s, 1), "stages_jvm_cpu_s": cpu, "tables": stats,
                         **({"profile": profile} if profile else {})})
            load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
            runs[-1]["loadavg"] = load  # 1, 5, 15 min: above 2 the 2-core machine was shared with other work
            print(f"{label}: {counts['lines']:,} records in {elapsed:.1f}s = {rate:,.0f} records/s  stages {stages}"
                  f"  JVM CPU {cpu_s:.1f}s {cpu}  loadavg {' '.join(load)}")
        print(f"tables: {runs[-1]['tables']}")
        assert runs[-1]["tables"]["duplicates"] == counts["duplicates"], "dedup count differs from what was put in"
        assert runs[-1]["tables"]["quarantine"] == counts["malformed_lines"], "quarantine differs from what was put in"
        if args.report:
            from pipeline.report import write_report

            t = time.monotonic()
            write_report(spark, str(tables), DAY, DAY, args.report, generated=dt.datetime.now(dt.UTC))
            print(f"report {args.report} in {time.monotonic() - t:.1f}s")
        spark.stop()
        if args.json:
            Path(args.json).write_text(json.dumps({"records": counts["lines"], "input": counts, "runs": runs},
                                                  indent=2) + "\n")
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
