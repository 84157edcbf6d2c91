"""`python -m tenantq.demo` (the README's first command).

Enqueues a whale's bulk import next to small tenants' interactive reports,
a flaky webhook and poison jobs, drains them with a worker while showing
progress, and prints what each tenant experienced.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import click
import psycopg
from psycopg import sql as pgsql
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tenantq import JobSpec, Queue
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.registry import REGISTRY, load_app
from tenantq.sandbox.inline import InlineExecutor
from tenantq.store.db import Database

console = Console()
SMALL_TENANTS = ["acme", "globex", "initech", "umbrella", "hooli"]


def _reset_schema(db: Database) -> None:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(db.schema)))


def _enqueue(q: Queue, whale_jobs: int, small_jobs: int) -> int:
    specs: list[JobSpec] = [
        JobSpec("whale", "demo.import_row", {"Email": f"user{i}@whale.example", "Plan": "pro"},
                priority="bulk")
        for i in range(whale_jobs)
    ]
    q.enqueue_many(specs)
    small: list[JobSpec] = []
    for tenant in SMALL_TENANTS:
        small += [JobSpec(tenant, "demo.render_report", {"month": m % 12 + 1}, priority="interactive")
                  for m in range(small_jobs)]
        small.append(JobSpec(tenant, "demo.flaky_webhook", {"event": "invoice.paid"}))
    small += [JobSpec("mallory", "demo.poison", {"invoice": f"INV-{i}"}, max_attempts=3)
              for i in range(3)]
    q.enqueue_many(small)
    return len(specs) + len(small)


def _summary(db: Database) -> list[dict[str, Any]]:
    with db.connect() as conn:
        return conn.execute(
            """SELECT tenant_id, status, kind, last_error,
                      extract(epoch FROM started_at - created_at) AS wait
               FROM jobs ORDER BY tenant_id, id"""
        ).fetchall()


@click.command()
@click.option("--whale-jobs", default=3000, show_default=True)
@click.option("--small-jobs", default=20, show_default=True, help="Interactive jobs per small tenant.")
@click.option("--concurrency", default=4, show_default=True)
@click.option("--schema", default="tenantq_demo", show_default=True,
              help="Schema the demo (re)creates; your own tenantq schema is untouched.")
def main(whale_jobs: int, small_jobs: int, concurrency: int, schema: str) -> None:
    db = Database.resolve(schema=schema)
    console.print(f"[bold]tenantq demo[/] on {db.dsn.split('@')[-1]} (schema {schema})")
    _reset_schema(db)
    q = Queue(db.dsn, schema=schema)
    q.migrate()
    load_app("tenantq.demo.handlers")
    t0 = time.perf_counter()
    total = _enqueue(q, whale_jobs, small_jobs)
    console.print(f"enqueued {total} jobs in {time.perf_counter() - t0:.2f}s "
                  f"(whale: {whale_jobs} bulk rows; {len(SMALL_TENANTS)} small tenants: "
                  f"{small_jobs} interactive reports each; mallory: 3 poison jobs)")
    worker = Worker(db, InlineExecutor(REGISTRY), WorkerConfig(
        concurrency=concurrency, batch_size=25, once=False, poll_seconds=0.2,
        backoff=Backoff(base_seconds=0.2, cap_seconds=1.0)))
    runner = threading.Thread(target=worker.run, daemon=True)
    t0 = time.perf_counter()
    runner.start()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("draining", total=total)
        while True:
            rows = q.status()
            finished = sum(int(r["done"]) + int(r["dead"]) for r in rows)
            progress.update(task, completed=finished)
            if finished >= total:
                break
            runner.join(timeout=0.2)
    elapsed = time.perf_counter() - t0
    worker.stop()
    runner.join()
    _print_summary(_summary(db), elapsed, whale_jobs)
    q.close()
    console.print(f"\nLook around: [bold]TENANTQ_SCHEMA={schema} .venv/bin/tenantq status[/] · "
                  "[bold]tenantq dead list[/] · [bold]tenantq job ID[/]")


def _print_summary(rows: list[dict[str, Any]], elapsed: float, whale_jobs: int) -> None:
    table = Table(title="What each tenant experienced")
    for col in ("tenant", "jobs", "done", "dead", "wait p50", "wait max"):
        table.add_column(col, justify="left" if col == "tenant" else "right")
    by_tenant: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_tenant.setdefault(r["tenant_id"], []).append(r)
    for tenant, jobs in by_tenant.items():
        waits = [float(r["wait"]) for r in jobs if r["wait"] is not None and r["status"] == "done"]
        table.add_row(tenant, str(len(jobs)), str(sum(r["status"] == "done" for r in jobs)),
                      str(sum(r["status"] == "dead" for r in jobs)),
                      f"{statistics.median(waits):.2f}s" if waits else "-",
                      f"{max(waits):.2f}s" if waits else "-")
    console.print(table)
    console.print(f"drained {len(rows)} jobs in {elapsed:.1f}s "
                  f"({len(rows) / elapsed:,.0f} jobs/s; whale: {whale_jobs} rows)")
    dead = [r for r in rows if r["status"] == "dead"]
    if dead:
        console.print(f"[bold]{len(dead)} poison job(s) contained in the dead-letter list:[/]")
        for r in dead:
            console.print(f"  {r['tenant_id']} {r['kind']}: {str(r['last_error']).splitlines()[0]}")


if __name__ == "__main__":
    main()
