"""What hostile guest output costs the dispatcher: peak RSS (VmHWM) of a
`tenantq worker` process while one job prints 1 GiB on stdout and stderr,
one writes a 1 GiB line without a newline on every descriptor it has, and
one returns a 100 MiB result; against the same worker running honest jobs
only. Each scenario is a fresh `worker --once` on each driver."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import machine_info, save, scratch_schema
from tenantq import JobSpec, Queue
from tenantq.sandbox.drivers import bwrap_works, runsc_works

console = Console(width=150)
APP = "bench.boundary_app"
SCENARIOS = {
    "honest (10 echo jobs)": [],
    "1 GiB on stdout + stderr": ["boundary.print"],
    "1 GiB line on every fd": ["boundary.line"],
    "100 MiB result": ["boundary.result"],
}


def _peak_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _run(db: Any, driver: str, kinds: list[str]) -> dict[str, Any]:
    queue = Queue(dsn=db.dsn, schema=db.schema)
    try:
        ids = queue.enqueue_many([JobSpec(tenant="acme", kind="boundary.echo", payload={"n": n})
                                  for n in range(10)])
        hostile = queue.enqueue_many([JobSpec(tenant="mallory", kind=k, max_attempts=1) for k in kinds])
        env = {**os.environ, "TENANTQ_DATABASE_URL": db.dsn, "TENANTQ_SCHEMA": db.schema}
        started = time.monotonic()
        command = [sys.executable, "-m", "tenantq.cli", "worker", "--app", APP, "--sandbox", driver,
                   "--once", "--concurrency", "2", "--batch-size", "10"]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        peak = 0.0
        while proc.poll() is None:
            peak = max(peak, _peak_rss_mb(proc.pid))
            time.sleep(0.05)
        _, err = proc.communicate()
        jobs = [queue.job(i) for i in ids + hostile]
        return {"exit": proc.returncode, "peak_rss_mb": peak, "seconds": time.monotonic() - started,
                "honest_done": sum(j.status == "done" for j in jobs[:len(ids)]),
                "hostile": [f"{j.status}: {(j.last_error or '')[:70]}" for j in jobs[len(ids):]],
                "stderr": err.decode(errors="replace")[-300:] if proc.returncode else ""}
    finally:
        queue.close()


def run(drivers: tuple[str, ...] = ("gvisor", "process")) -> dict[str, Any]:
    works = {"gvisor": runsc_works(), "process": bwrap_works()}
    rows: list[dict[str, Any]] = []
    with scratch_schema("bench_boundary") as db:
        info = machine_info(db)
        for driver in drivers:
            if not works[driver]:
                console.print(f"[yellow]{driver}: not available here, skipped")
                continue
            baseline = None
            for name, kinds in SCENARIOS.items():
                r = _run(db, driver, kinds)
                baseline = r["peak_rss_mb"] if baseline is None else baseline
                rows.append({"driver": driver, "scenario": name, **r,
                             "over_idle_mb": r["peak_rss_mb"] - baseline})
    table = Table(title="Dispatcher peak RSS under hostile guest output (worker --once, concurrency 2)")
    for col in ("driver", "scenario", "peak RSS MB", "over honest MB", "honest done", "hostile job", "s"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["driver"], r["scenario"], f"{r['peak_rss_mb']:.0f}", f"{r['over_idle_mb']:+.0f}",
                      f"{r['honest_done']}/10", "; ".join(r["hostile"]) or "-", f"{r['seconds']:.1f}")
    console.print(table)
    payload = {"benchmark": "boundary", "machine": info, "rows": rows}
    console.print(f"saved {save('boundary', payload)}")
    return payload
