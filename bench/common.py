"""Shared plumbing for benchmarks: a scratch schema, machine info, results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

import tenantq
from tenantq.store.db import Database
from tenantq.store.migrate import migrate

RESULTS = Path(__file__).resolve().parent / "results"


@contextmanager
def scratch_schema(prefix: str = "bench", dsn: str | None = None) -> Iterator[Database]:
    """A freshly migrated schema (on `dsn`, else the configured server), dropped afterwards."""
    base = Database.resolve(dsn)
    db = Database(dsn=base.dsn, schema=f"{prefix}_{uuid.uuid4().hex[:8]}")
    migrate(db)
    try:
        yield db
    finally:
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(db.schema)))


@contextmanager
def spawned(ctx: Any, target: Callable[..., None], args: tuple[Any, ...], n: int) -> Iterator[list[Any]]:
    """`n` processes of `target(*args, ready)` (spawn context `ctx`), started
    and set up: each sets its own `ready` Event first. Killed on the way out
    if still alive."""
    ready = [ctx.Event() for _ in range(n)]
    procs = [ctx.Process(target=target, args=(*args, r)) for r in ready]
    try:
        for proc in procs:
            proc.start()
        for r in ready:
            if not r.wait(120):
                raise RuntimeError(f"a {getattr(target, '__name__', 'worker')} process did not start")
        yield procs
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()


def machine_info(db: Database) -> dict[str, Any]:
    with psycopg.connect(db.dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        # Dead rows in the system catalog: a server with autovacuum off (this
        # repo's CI server) that has seen many schemas created and dropped
        # (the test suite) carries hundreds of thousands, and every statement
        # ran slower on it: on 2026-12-05, 633,000 dead rows in pg_attribute
        # made a bare one-row INSERT 0.40-0.47 ms instead of 0.25 (and the
        # throughput run on it, in a noisy half hour too, came out about 1.7
        # times slower for every system: docs/benchmarks.md, "Throughput").
        # Reported with each result; VACUUM the catalog first.
        catalog = conn.execute(
            "SELECT coalesce(sum(n_dead_tup), 0) AS dead, coalesce(sum(n_live_tup), 0) AS live"
            " FROM pg_stat_sys_tables WHERE schemaname = 'pg_catalog'").fetchone()
    if catalog is not None and int(catalog[0]) > 100_000:
        print(f"warning: the server's catalog holds {int(catalog[0]):,} dead rows (is autovacuum off?); "
              "every statement runs slower on it: VACUUM the pg_catalog tables before measuring",
              file=sys.stderr)
    try:
        cpu = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        cpu = str(os.cpu_count())
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": cpu,
        "postgres": row[0] if row else "?",
        "tenantq": tenantq.__version__,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "catalog_dead_rows": int(catalog[0]) if catalog is not None else None,
        "catalog_live_rows": int(catalog[1]) if catalog is not None else None,
    }


def summarise(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def save(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
