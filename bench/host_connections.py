"""Connections under load (docs/tenant-data.md, "Connections"): N sandboxed
batches at once (the process driver, bubblewrap: N gVisor sandboxes do not
fit a small machine), each calling a slow host function (a 50 ms tenant-
scoped query through `ctx.db()`) back to back, on one worker whose
application-database pool holds P connections.

Sampled every 50 ms from `pg_stat_activity` and the batches table: the
application-database connections (`application_name = 'tenantq-app-db'`),
tenantq's own store connections, and the live batches. While that load holds
the app pool, quick jobs that call nothing are enqueued: their enqueue ->
done latency, beside the same jobs on the idle worker before the load, shows
whether the store's connections are starved (they are a separate pool).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql
from psycopg.conninfo import make_conninfo
from rich.console import Console
from rich.table import Table

from bench.common import machine_info, save, scratch_schema
from tenantq import JobSpec, Queue
from tenantq.sandbox.drivers import bwrap_works
from tenantq.store.db import Database
from tenantq.tenant_data import APPLICATION_NAME

console = Console(width=150)
ROOT = Path(__file__).resolve().parents[1]
APP = "bench.host_connections_app"
BENCH_APP_NAME = "tenantq-bench"
SAMPLE_SECONDS = 0.05
# a batch is "calling" if its job's last call started this recently (each
# call holds a connection 50 ms, but waits its turn for one: up to
# batches/pool x 50 ms)
CALLING_SECONDS = 3.0


class Sampler:
    """Peaks of the connections and of the batches calling at once (a job
    that called within the last CALLING_SECONDS, from the host function's
    marks), sampled on one connection."""

    def __init__(self, db: Database, marks: Path, app_database: str, store_name: str) -> None:
        self.db = db
        self.marks = marks
        self.app_database = app_database
        self.store_name = store_name
        self.peak = {"app": 0, "store": 0, "calling": 0, "app_at_peak_calling": 0}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        dsn = make_conninfo(self.db.dsn, application_name=BENCH_APP_NAME)
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not self._stop.wait(SAMPLE_SECONDS):
                # the app database is one of this run's own, so nothing else's
                # connections are counted with the worker's
                row = conn.execute(
                    "SELECT count(*) FILTER (WHERE datname = %(appdb)s AND application_name = %(app)s),"
                    " count(*) FILTER (WHERE datname = current_database() AND application_name = %(store)s)"
                    " FROM pg_stat_activity",
                    {"app": APPLICATION_NAME, "appdb": self.app_database, "store": self.store_name},
                ).fetchone()
                assert row is not None
                app, store = int(row[0]), int(row[1])
                calling = self._calling()
                self.samples += 1
                self.peak["app"] = max(self.peak["app"], app)
                self.peak["store"] = max(self.peak["store"], store)
                if calling >= self.peak["calling"]:
                    self.peak["calling"] = calling
                    self.peak["app_at_peak_calling"] = app

    def _calling(self) -> int:
        since = time.time() - CALLING_SECONDS
        count = 0
        for mark in self.marks.iterdir():
            try:
                count += mark.stat().st_mtime >= since
            except FileNotFoundError:
                continue
        return count

    def calling(self) -> int:
        return self.peak["calling"]


@contextmanager
def _database(db: Database, name: str) -> Iterator[str]:
    """A database of this run's own for the app's connections (so that
    pg_stat_activity tells them from anyone else's); its URL."""
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
    try:
        yield make_conninfo(db.dsn, dbname=name)
    finally:
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(pgsql.Identifier(name)))


def _quick_latencies(queue: Queue, count: int) -> list[float]:
    """Enqueue -> done of `count` jobs that call nothing, all at once."""
    t0 = time.monotonic()
    ids = queue.enqueue_many([JobSpec(tenant=f"quiet{i}", kind="hostconn.quick") for i in range(count)])
    took = []
    for job_id in ids:
        info = queue.wait(job_id, timeout=300)
        assert info.status == "done", (info.status, info.last_error)
        assert info.finished_at is not None
        took.append(time.monotonic() - t0)
    return took


def run(batches: int = 200, pool: int = 10, quick: int = 10, ramp_timeout: float = 400.0) -> dict[str, Any]:
    if not bwrap_works():
        console.print("host-connections: skipped: bubblewrap does not work here")
        with scratch_schema("hostconn") as db:
            skipped = {"benchmark": "host-connections", "skipped": "bubblewrap does not work here",
                       "machine": machine_info(db)}
        save("host-connections", skipped)
        return skipped
    tag = uuid.uuid4().hex[:8]
    app_database, store_name = f"tqbench_hostconn_{tag}", f"tqbench-store-{tag}"
    with scratch_schema("hostconn") as db, tempfile.TemporaryDirectory() as tmp, \
            _database(db, app_database) as app_url:
        stop_file, marks = Path(tmp) / "stop", Path(tmp) / "marks"
        marks.mkdir()
        env = {**os.environ, "TENANTQ_DATABASE_URL": make_conninfo(db.dsn, application_name=store_name),
               "TENANTQ_SCHEMA": db.schema,
               "TENANTQ_DATA_DIR": str(Path(tmp) / "data"), "TENANTQ_APP_DB_POOL_SIZE": str(pool),
               "HOSTCONN_STOP_FILE": str(stop_file), "HOSTCONN_MARK_DIR": str(marks),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        argv = [sys.executable, "-m", "tenantq.cli", "worker", "--app", APP, "--sandbox", "process",
                "--concurrency", str(batches + quick), "--batch-size", "1", "--app-db", app_url,
                "--poll-seconds", "0.2"]
        log = Path(tmp) / "worker.log"
        with open(log, "wb") as out:
            worker = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        queue = Queue(make_conninfo(db.dsn, application_name=BENCH_APP_NAME), schema=db.schema)
        try:
            idle = _quick_latencies(queue, quick)
            with Sampler(db, marks, app_database, store_name) as sampler:
                started = time.monotonic()
                holds = queue.enqueue_many([JobSpec(tenant=f"t{i:03d}", kind="hostconn.hold",
                                                    payload={"until": time.time() + ramp_timeout + 120,
                                                             "seconds": 0.05})
                                            for i in range(batches)])
                deadline = started + ramp_timeout
                while sampler.calling() < batches and time.monotonic() < deadline:
                    time.sleep(0.5)
                ramp = time.monotonic() - started
                loaded = _quick_latencies(queue, quick)
                stop_file.write_text("stop")
                results = [queue.wait(h, timeout=120) for h in holds]
            peak, samples = dict(sampler.peak), sampler.samples
        finally:
            stop_file.write_text("stop")
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=120)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            queue.close()
        calls = sum(int(r.result["ok"]) for r in results if r.status == "done")
        errors = sum(int(r.result["errors"]) for r in results if r.status == "done")
        done = sum(1 for r in results if r.status == "done")
        out = {"benchmark": "host-connections", "batches": batches, "pool": pool, "done": done,
               "calls": calls, "call_errors": errors,
               "ramp_seconds": round(ramp, 1), "peak": peak, "samples": samples,
               "quick_idle_p50": statistics.median(idle), "quick_loaded_p50": statistics.median(loaded),
               "quick_idle_max": max(idle), "quick_loaded_max": max(loaded),
               "machine": machine_info(db), "worker_log_tail": log.read_text(errors="replace")[-2000:]}
    table = Table(title=f"Connections: {batches} sandboxed batches calling a 50 ms host function, "
                        f"app-db pool {pool} (process driver)")
    for column in ("measure", "value"):
        table.add_column(column)
    table.add_row(f"batches calling at once, peak (a call in the last {CALLING_SECONDS:g} s)",
                  str(peak["calling"]))
    table.add_row("app-db connections, max over the run (pg_stat_activity)", str(peak["app"]))
    table.add_row("app-db connections when the most batches were calling", str(peak["app_at_peak_calling"]))
    table.add_row("tenantq store connections, max (its pool and the LISTEN one)", str(peak["store"]))
    table.add_row("host-function calls answered / failed", f"{calls} / {errors}")
    table.add_row(f"{quick} quick jobs, enqueue -> done, idle worker (p50 / max)",
                  f"{out['quick_idle_p50']:.2f} s / {out['quick_idle_max']:.2f} s")
    table.add_row(f"{quick} quick jobs, same, while the app pool is saturated (p50 / max)",
                  f"{out['quick_loaded_p50']:.2f} s / {out['quick_loaded_max']:.2f} s")
    table.add_row("time until every batch was calling", f"{ramp:.1f} s")
    console.print(table)
    console.print(f"samples: {samples} every {SAMPLE_SECONDS * 1000:.0f} ms; {done}/{batches} hold jobs done")
    # the claim this bench checks (docs/tenant-data.md, "Connections")
    out["holds"] = peak["app"] <= pool and done == batches and errors == 0
    console.print(f"verdict: app-database connections {peak['app']} <= pool {pool} with "
                  f"{peak['calling']} batches calling: {'holds' if out['holds'] else 'DOES NOT HOLD'}")
    save("host-connections", out)
    return out
