"""Warm starts: time-to-first-job and end-to-end jobs/s for cold,
restored-from-template and kept-warm sandboxes, with an app whose warmup
imports several heavy standard-library and third-party modules.

Time-to-first-job: from handing a one-job batch to the executor until the
job's result is reported (sandbox start, the app's imports or the restore,
the job itself). Samples of the modes are interleaved, so drift in the
machine's load hits them alike. Kept-warm is measured after one priming
batch (its sandbox then waits for the next one); restored after the template
was built (build time reported on its own: it happens once per app version).

Goal on this machine: restored <= 0.5x cold, kept-warm <= 0.35x cold.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import tenantq
from bench.common import machine_info, save, scratch_schema
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.contract import JobEnded, JobStarted
from tenantq.dispatch.executors.sandboxed import SandboxExecutor
from tenantq.dispatch.executors.warm import WarmPolicy
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.domain.records import Batch, ClaimedJob
from tenantq.registry import REGISTRY
from tenantq.sandbox.driver import SandboxDriver
from tenantq.sandbox.drivers import bwrap_works, runsc_works
from tenantq.sandbox.drivers.gvisor import GVisorDriver
from tenantq.sandbox.drivers.process import ProcessDriver

console = Console(width=150)
APP = "bench.warm_app"
MODES: dict[str, WarmPolicy] = {
    "cold": WarmPolicy(snapshots=False),
    "restored": WarmPolicy(snapshots=True),
    "kept-warm": WarmPolicy(snapshots=True, keep_warm_seconds=600),
    # a pristine sandbox per batch, restored (gvisor) or booted (process)
    # ahead of demand; time to first job is measured with the pool refilled
    "ready-pool": WarmPolicy(snapshots=True, ready_pool=1),
}
GOALS = {"restored": 0.5, "kept-warm": 0.35}


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def first_job_seconds(executor: SandboxExecutor, seq: int, kind: str = "warmbench.noop") -> float:
    """One one-job batch: seconds until its result is reported."""
    batch = Batch(seq, "bench", "default", datetime.now(UTC),
                  (ClaimedJob(seq, "bench", kind, None, 1, 3),))
    done: list[float] = []
    started = time.perf_counter()

    def report(event: JobStarted | JobEnded) -> None:
        if isinstance(event, JobEnded):
            assert event.ok, event
            done.append(time.perf_counter() - started)

    executor.run(batch, env={}, report=report, should_stop=lambda: False)
    assert done, "the job never ended"
    return done[0]


# end to end, also: kept warm with a handler that lets consecutive jobs of
# its kind in a batch share one process (process="batch": no fork per job)
SHARED = "kept-warm, process=batch"


def drain(driver: SandboxDriver, policy: WarmPolicy, kind: str, batch_size: int, jobs: int,
          concurrency: int = 2) -> dict[str, float]:
    """A fresh executor (nothing kept warm from before; the template, on
    disk, is shared) under a real worker drains `jobs` jobs of 4 tenants:
    jobs/s, and seconds from the worker's start to its first job's end."""
    executor = SandboxExecutor(driver, REGISTRY, APP, policy=policy)
    with scratch_schema("warm") as db:
        q = Queue(db.dsn, schema=db.schema)
        ids = q.enqueue_many([JobSpec(f"t{i % 4}", kind, {}) for i in range(jobs)])
        worker = Worker(db, executor, WorkerConfig(concurrency=concurrency, batch_size=batch_size, once=True))
        began = datetime.now(UTC)
        t0 = time.perf_counter()
        stats = worker.run()  # the worker closes the executor when it is done
        elapsed = time.perf_counter() - t0
        if stats.done != jobs:
            # say what happened instead of losing the whole run
            infos = [q.job(i) for i in ids]
            failed = [(j.id, j.last_error) for j in infos if j.attempts > 1 or j.status != "done"]
            console.print(f"[red]{driver.name} {kind} batch {batch_size}: {stats.snapshot()} {failed[:3]}")
        with db.connect() as conn:
            row = conn.execute("SELECT extract(epoch FROM min(finished_at) - %(t)s) AS first FROM jobs",
                               {"t": began}).fetchone()
        q.close()
    assert row is not None
    return {"jobs_per_s": stats.done / elapsed, "first_job_s": float(str(row["first"])),
            "done": float(stats.done)}


def end_to_end(driver: SandboxDriver, mode: str, batch_size: int, jobs: int) -> float:
    kind = "warmbench.sleep10_shared" if mode == SHARED else "warmbench.sleep10"
    policy = MODES["kept-warm" if mode == SHARED else mode]
    return drain(driver, policy, kind, batch_size, jobs)["jobs_per_s"]


def drivers_here(data_dir: Path) -> dict[str, SandboxDriver]:
    """The sandbox drivers that work on this machine."""
    drivers: dict[str, SandboxDriver] = {}
    if runsc_works():
        drivers["gvisor"] = GVisorDriver(data_dir)
    if bwrap_works():
        drivers["process"] = ProcessDriver(data_dir)
    return drivers


def sample_first_jobs(executors: dict[str, SandboxExecutor], n: int, reference: str,
                      kind: str = "warmbench.noop") -> dict[str, list[float]]:
    """n time-to-first-job samples per executor, interleaved so that drift
    in the machine's load hits every mode alike; the reference (kept warm)
    and the ready pool are primed first, and the pool refilled, untimed,
    before each sample."""
    first_job_seconds(executors[reference], 0, kind)  # prime: its sandbox stays warm
    first_job_seconds(executors["ready-pool"], 0, kind)  # prime: its pool starts filling
    samples: dict[str, list[float]] = {mode: [] for mode in executors}
    for i in range(n):
        for mode, ex in executors.items():
            _refilled(ex)
            samples[mode].append(first_job_seconds(ex, i + 1, kind))
    return samples


def _modes(driver: SandboxDriver) -> list[str]:
    return list(MODES) if driver.snapshots else ["cold", "kept-warm", "ready-pool"]


def _refilled(executor: SandboxExecutor) -> None:
    """Wait (untimed) until the executor's ready pool holds a sandbox."""
    pool = executor.warm.pool
    if pool is None:
        return
    spec = executor.spec("bench", 60)
    key = executor.warm._pool_key(spec, executor.template_key(spec))
    deadline = time.monotonic() + 120
    while pool.ready(key) < 1:
        assert time.monotonic() < deadline, "the ready pool did not refill in 120 s"
        time.sleep(0.01)


def run(*, n: int = 20, jobs_per_size: dict[int, int] | None = None) -> dict[str, Any]:
    import bench.warm_app  # noqa: F401  (registers warmbench.*)

    sizes = jobs_per_size or {1: 60, 10: 300, 100: 1000}
    data_dir = Path(tempfile.mkdtemp(prefix="tenantq-bench-warm-"))
    drivers = drivers_here(data_dir)
    ttfj: dict[str, dict[str, list[float]]] = {}
    rates: dict[str, dict[str, dict[int, float]]] = {}
    build_seconds: dict[str, float] = {}
    try:
        for name, driver in drivers.items():
            executors = {mode: SandboxExecutor(driver, REGISTRY, APP, policy=MODES[mode])
                         for mode in _modes(driver)}
            try:
                if "restored" in executors:
                    ex = executors["restored"]
                    t0 = time.perf_counter()
                    assert ex.warm.template(ex.spec("template", 60)) is not None, "template build failed"
                    build_seconds[name] = time.perf_counter() - t0
                ttfj[name] = sample_first_jobs(executors, n, "kept-warm")
                rates[name] = {mode: {size: end_to_end(driver, mode, size, jobs)
                                      for size, jobs in sizes.items()} for mode in [*executors, SHARED]}
            finally:
                for ex in executors.values():
                    ex.close()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    _print(ttfj, rates, build_seconds, sizes, n)
    with scratch_schema("info") as db:
        info = machine_info(db)
    payload = {"benchmark": "warm", "machine": info, "settings": {"n": n, "jobs_per_size": sizes},
               "template_build_seconds": build_seconds,
               "time_to_first_job_ms": {d: {m: [s * 1000 for s in v] for m, v in by.items()}
                                        for d, by in ttfj.items()},
               "jobs_per_second": rates, "tenantq": tenantq.__version__}
    console.print(f"wrote {save('warm', payload)}")
    return payload


def _print(ttfj: dict[str, dict[str, list[float]]], rates: dict[str, dict[str, dict[int, float]]],
           build_seconds: dict[str, float], sizes: dict[int, int], n: int) -> None:
    table = Table(title=f"time to first job (warmup imports 12 heavy modules), n={n}, ms")
    for col in ("driver", "sandbox", "p50", "p99", "vs cold (p50)", "goal"):
        table.add_column(col, justify="left" if col in ("driver", "sandbox") else "right")
    for name, by_mode in ttfj.items():
        cold = statistics.median(by_mode["cold"])
        for mode, samples in by_mode.items():
            p50 = statistics.median(samples)
            goal = GOALS.get(mode) if name == "gvisor" else None
            verdict = "" if goal is None else (f"<= {goal}x " + ("met" if p50 / cold <= goal else "MISSED"))
            table.add_row(name, mode, f"{p50 * 1000:.0f}", f"{_pct(samples, 0.99) * 1000:.0f}",
                          f"{p50 / cold:.2f}x", verdict)
    console.print(table)
    for name, seconds in build_seconds.items():
        console.print(f"{name}: template built once in {seconds * 1000:.0f} ms")
    t2 = Table(title="end to end: 10 ms handler, 4 tenants, concurrency 2, jobs/s")
    t2.add_column("driver")
    t2.add_column("sandbox")
    for size in sizes:
        t2.add_column(f"batch {size}", justify="right")
    for name, by_mode in rates.items():
        for mode, by_size in by_mode.items():
            cells = [f"{rate:,.1f} ({rate / by_mode['cold'][size]:.2f}x)" for size, rate in by_size.items()]
            t2.add_row(name, mode, *cells)
    console.print(t2)
