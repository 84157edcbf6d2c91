"""Many workers on one Postgres, one global schedule: 1, 2, 4 and 8 worker
processes (each `--concurrency 2`, inline handlers, fair scheduling on) at
batch 10 and batch 100, on no-op and 5 ms jobs.

Every pick of a class, from every worker, takes that class's one scheduler
cursor row lock in turn. Per point: total jobs/s; the picks per second; how
long each pick waited for the lock and held it (the worker's own timing,
`tenantq_pick_lock_wait_seconds` / `_held_seconds`); the share of the
slots' time spent waiting for it; the lock's busy share (held time per
second: at 1.0 the lock, not the machine, caps the picks); and a small
tenant's wait behind a whale (a job every 100 ms, started_at - created_at).

The backlog: a whale with half the jobs and 9 other tenants, enough that
no point drains it. Points are measured for `seconds` after a warm-up.
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from typing import Any

from rich.console import Console
from rich.table import Table

import tenantq
from bench.common import machine_info, save, scratch_schema, spawned
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.registry import Registry
from tenantq.store.db import Database

console = Console(width=160)
REGISTRY = Registry()
CONCURRENCY = 2
SMALL_EVERY = 0.1  # seconds between the small tenant's jobs


@tenantq.handler("scale.noop", isolation="inline", registry=REGISTRY)
def _noop(payload: Any, ctx: tenantq.JobContext) -> None:
    return None


@tenantq.handler("scale.sleep5", isolation="inline", registry=REGISTRY)
def _sleep5(payload: Any, ctx: tenantq.JobContext) -> None:
    time.sleep(0.005)


KINDS = {"no-op": "scale.noop", "5 ms": "scale.sleep5"}
# what the measured window [s, e] did
WINDOW = """
SELECT count(*) FILTER (WHERE finished_at BETWEEN %(s)s AND %(e)s) AS done,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - created_at))
           FILTER (WHERE tenant_id = 'small' AND started_at BETWEEN %(s)s AND %(e)s) AS small_p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - created_at))
           FILTER (WHERE tenant_id = 'small' AND started_at BETWEEN %(s)s AND %(e)s) AS small_p99
FROM jobs
"""


def _lock_sums() -> dict[str, float]:
    from tenantq.observe.metrics import REGISTRY as METRICS

    def value(name: str) -> float:
        return METRICS.get_sample_value(name, {"priority": "default"}) or 0.0

    return {"wait": value("tenantq_pick_lock_wait_seconds_sum"),
            "held": value("tenantq_pick_lock_held_seconds_sum"),
            "picks": value("tenantq_pick_lock_held_seconds_count")}


def _point(dsn: str, *, processes: int, batch_size: int, kind: str, jobs: int, warmup: float,
           seconds: float) -> dict[str, Any]:
    with scratch_schema("scale", dsn) as db:
        q = Queue(db.dsn, schema=db.schema)
        specs = [JobSpec("whale" if i % 2 else f"t{i % 9}", kind) for i in range(jobs)]
        q.enqueue_many(specs)
        ctx = multiprocessing.get_context("spawn")
        go, opened, closed, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
        args = (db.dsn, db.schema, batch_size, go, opened, closed, out)
        with spawned(ctx, _measured_worker, args, processes) as procs:
            go.set()
            small = _SmallTenant(q, kind)
            small.start()
            time.sleep(warmup)  # the bench's own pacing: workers are measured from here
            start = _db_clock(db)
            opened.set()
            begun = [out.get(timeout=60) for _ in procs]
            time.sleep(seconds)
            end = _db_clock(db)
            closed.set()
            ended = [out.get(timeout=120) for _ in procs]
            small.stop()
            for proc in procs:
                proc.join(60)
        with db.connect() as conn:
            row = conn.execute(WINDOW, {"s": start, "e": end}).fetchone()
        q.close()
    assert row is not None
    elapsed = (end - start).total_seconds()
    sums = {k: sum(e[k] - b[k] for b, e in zip(begun, ended, strict=True)) for k in ("wait", "held", "picks")}
    picks = max(sums["picks"], 1.0)
    slots = processes * CONCURRENCY
    return {
        "jobs_per_s": int(str(row["done"])) / elapsed,
        "picks_per_s": sums["picks"] / elapsed,
        "lock_wait_ms": sums["wait"] / picks * 1000,
        "lock_held_ms": sums["held"] / picks * 1000,
        "wait_share_of_slots": sums["wait"] / (elapsed * slots),
        "lock_busy": sums["held"] / elapsed,
        "small_wait_p50_ms": float(str(row["small_p50"] or 0)) * 1000,
        "small_wait_p99_ms": float(str(row["small_p99"] or 0)) * 1000,
        "pending_left": int(str(row["pending"])),
    }


def _measured_worker(dsn: str, schema: str, batch_size: int, go: Any, opened: Any, closed: Any, out: Any,
                     ready: Any) -> None:
    """A worker process: runs from `go`; reports its lock sums as the
    measured window opens and as it closes, then stops."""
    worker = Worker(Database(dsn=dsn, schema=schema), InlineExecutor(REGISTRY),
                    WorkerConfig(concurrency=CONCURRENCY, batch_size=batch_size))
    ready.set()
    go.wait()
    runner = threading.Thread(target=worker.run, daemon=True)
    runner.start()
    opened.wait()
    out.put(_lock_sums())
    closed.wait()
    out.put(_lock_sums())
    worker.stop()
    runner.join(60)


class _SmallTenant:
    """Enqueues one job for tenant "small" every SMALL_EVERY seconds."""

    def __init__(self, q: Queue, kind: str) -> None:
        self.q, self.kind = q, kind
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(SMALL_EVERY):
            self.q.enqueue("small", self.kind)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)


def _db_clock(db: Database) -> Any:
    with db.connect() as conn:
        row = conn.execute("SELECT clock_timestamp() AS t").fetchone()
    assert row is not None
    return row["t"]


def run(*, processes: tuple[int, ...] = (1, 2, 4, 8), batches: tuple[int, ...] = (10, 100),
        kinds: tuple[str, ...] = ("no-op", "5 ms"), jobs: dict[str, int] | None = None, warmup: float = 3.0,
        seconds: float = 8.0) -> dict[str, Any]:
    """`jobs`: the backlog per kind of job, more than any point drains in
    warmup + seconds (a point that drained it says so)."""
    backlog = jobs or {"no-op": 250_000, "5 ms": 60_000}
    dsn = Database.resolve().dsn
    with scratch_schema("scaleinfo", dsn) as db:
        info = machine_info(db)
    points: list[dict[str, Any]] = []
    for kind in kinds:
        for batch in batches:
            for procs in processes:
                result = _point(dsn, processes=procs, batch_size=batch, kind=KINDS[kind], jobs=backlog[kind],
                                warmup=warmup, seconds=seconds)
                points.append({"kind": kind, "batch_size": batch, "processes": procs, **result})
                console.print(points[-1])
    _print(points)
    payload = {"benchmark": "scale", "machine": info,
               "settings": {"processes": processes, "batches": batches, "kinds": kinds, "jobs": backlog,
                            "warmup": warmup, "seconds": seconds, "concurrency": CONCURRENCY,
                            "small_every_s": SMALL_EVERY},
               "points": points, "tenantq": tenantq.__version__}
    console.print(f"wrote {save('scale', payload)}")
    return payload


def _print(points: list[dict[str, Any]]) -> None:
    table = Table(title=f"many workers, one schedule: worker processes x concurrency {CONCURRENCY}, inline, "
                        "fair scheduling on; lock = the class's scheduler cursor row lock")
    for col in ("jobs", "batch", "processes", "jobs/s", "picks/s", "lock wait ms/pick", "lock held ms/pick",
                "slots' time waiting", "lock busy", "small wait p50 / p99 ms"):
        table.add_column(col, justify="right")
    for p in points:
        table.add_row(p["kind"], str(p["batch_size"]), str(p["processes"]), f"{p['jobs_per_s']:,.0f}",
                      f"{p['picks_per_s']:,.0f}", f"{p['lock_wait_ms']:.2f}", f"{p['lock_held_ms']:.2f}",
                      f"{p['wait_share_of_slots']:.0%}", f"{p['lock_busy']:.0%}",
                      f"{p['small_wait_p50_ms']:.0f} / {p['small_wait_p99_ms']:.0f}"
                      + ("" if p["pending_left"] else " (drained!)"))
    console.print(table)
    held = [p["lock_held_ms"] for p in points if p["processes"] == 1]
    if held:
        console.print(f"lock held per pick with one process: median {statistics.median(held):.2f} ms, "
                      f"so one class allows about {1000 / statistics.median(held):,.0f} picks/s in all")
