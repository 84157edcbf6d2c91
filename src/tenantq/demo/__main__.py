"""`python -m tenantq.demo` (the README's first command).

A whale's bulk import next to small tenants' interactive reports, a flaky
webhook, poison jobs (OOM, segfault, infinite loop, a parse error), a
tenant-supplied transform, and network calls under per-tenant egress rules
(acme may reach its CRM; mallory's exfiltration attempts are refused),
drained by a sandboxed worker (gVisor where runsc works, else bubblewrap;
sandboxes restored from a warm template and kept warm per tenant) with a live
progress view; then what each tenant experienced.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
from tenantq.errors import InvalidInput
from tenantq.observe import metrics
from tenantq.registry import REGISTRY, load_app
from tenantq.sandbox.batch import SandboxExecutor
from tenantq.sandbox.driver import get_driver
from tenantq.sandbox.egress import EgressConfig
from tenantq.sandbox.executor import BatchExecutor
from tenantq.sandbox.inline import InlineExecutor
from tenantq.sandbox.warm import WarmPolicy
from tenantq.settings import Settings
from tenantq.store.db import Database

console = Console()
SMALL_TENANTS = ["acme", "globex", "initech", "umbrella", "hooli"]
POISON = ("demo.resize_image", "demo.native_codec", "demo.sync_forever", "demo.parse_invoice")
TRANSFORM = "def transform(rows):\n    return {'total': sum(r['amount'] for r in rows), 'rows': len(rows)}\n"


def _reset_schema(db: Database) -> None:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(db.schema)))


class _CRM(BaseHTTPRequestHandler):
    """Stands in for a tenant's external CRM API (on 127.0.0.1, which the
    demo's egress proxy is told to allow)."""

    def do_GET(self) -> None:
        body = b"record stored"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def _egress_jobs(crm: str, sandboxed: bool) -> list[JobSpec]:
    if not sandboxed:
        return []
    return [JobSpec("acme", "demo.push_crm", {"crm": crm}),
            JobSpec("mallory", "demo.exfiltrate", {"targets": [crm, "http://pastebin.com/raw/upload"]},
                    max_attempts=1)]


def _enqueue(q: Queue, whale_jobs: int, small_jobs: int, poison: tuple[str, ...],
             extra: list[JobSpec]) -> int:
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
        small.append(JobSpec(tenant, "demo.audit_log", {"event": "report.viewed"}))
    small.append(JobSpec("initech", "tenantq.python", {"source": TRANSFORM,
                                                        "input": [{"amount": 120}, {"amount": 80}]}))
    small += [JobSpec("mallory", kind, {"invoice": "INV-7"}, max_attempts=2) for kind in poison]
    small += extra
    q.enqueue_many(small)
    return len(specs) + len(small)


def _rows(db: Database) -> list[dict[str, Any]]:
    with db.connect() as conn:
        return conn.execute(
            """SELECT tenant_id, status, kind, last_error, result,
                      extract(epoch FROM started_at - created_at) AS wait,
                      extract(epoch FROM finished_at - created_at) AS latency
               FROM jobs ORDER BY tenant_id, id"""
        ).fetchall()


@click.command()
@click.option("--whale-jobs", default=3000, show_default=True)
@click.option("--small-jobs", default=10, show_default=True, help="Interactive reports per small tenant.")
@click.option("--concurrency", default=4, show_default=True)
@click.option("--sandbox", type=click.Choice(["auto", "gvisor", "process"]), default="auto",
              show_default=True)
@click.option("--schema", default="tenantq_demo", show_default=True,
              help="Schema the demo (re)creates; your own tenantq schema is untouched.")
def main(whale_jobs: int, small_jobs: int, concurrency: int, sandbox: str, schema: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    db = Database.resolve(schema=schema)
    console.print(f"[bold]tenantq demo[/] on {db.dsn.split('@')[-1]} (schema {schema})")
    executor: BatchExecutor
    crm_server = ThreadingHTTPServer(("127.0.0.1", 0), _CRM)
    threading.Thread(target=crm_server.serve_forever, daemon=True).start()
    crm_port = crm_server.server_address[1]
    sandboxed = True
    try:
        driver, chosen = get_driver(sandbox, Settings().data_dir)
        console.print(chosen)
        executor = SandboxExecutor(driver, REGISTRY, "tenantq.demo.handlers",
                                   policy=WarmPolicy(keep_warm_seconds=30),
                                   egress=EgressConfig(allow_networks=("127.0.0.1/32",)))
        poison: tuple[str, ...] = POISON
    except InvalidInput as exc:
        # No sandbox on this machine: run the trusted path so the demo still
        # shows fairness, and leave out the poison jobs that only a sandbox
        # can contain (a segfault or an endless loop would take this process).
        console.print(f"[bold red]{exc}[/]\nRunning inline instead: fairness is shown, isolation is not; "
                      "the segfault, endless-loop and OOM jobs are left out.")
        executor = InlineExecutor(REGISTRY)
        poison = ("demo.parse_invoice",)
        sandboxed = False
    _reset_schema(db)
    q = Queue(db.dsn, schema=schema)
    q.migrate()
    q.set_tenant("whale", max_sandboxes=2)
    # acme may reach its CRM, mallory only its own API; every other tenant: no network
    q.set_tenant("acme", egress=f"127.0.0.1:{crm_port}")
    q.set_tenant("mallory", egress="api.mallory.example")
    load_app("tenantq.demo.handlers")
    t0 = time.perf_counter()
    crm = f"http://127.0.0.1:{crm_port}/records"
    total = _enqueue(q, whale_jobs, small_jobs, poison, _egress_jobs(crm, sandboxed))
    console.print(f"enqueued {total} jobs in {time.perf_counter() - t0:.2f}s: whale {whale_jobs} bulk rows "
                  f"(capped at 2 sandboxes); {len(SMALL_TENANTS)} small tenants with {small_jobs} "
                  "interactive reports, a flaky webhook and an inline audit log each; initech's own "
                  f"transform; mallory's {len(poison)} poison job(s) ({', '.join(poison)})")
    secrets = {t: {"API_KEY": f"{t}-key-{i}"} for i, t in enumerate([*SMALL_TENANTS, "whale", "mallory"])}
    worker = Worker(db, executor, WorkerConfig(
        concurrency=concurrency, batch_size=100, poll_seconds=0.2,
        backoff=Backoff(base_seconds=0.2, cap_seconds=1.0)), secrets=lambda t: secrets.get(t, {}))
    runner = threading.Thread(target=worker.run, daemon=True)
    t0 = time.perf_counter()
    runner.start()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(f"draining in {executor.name} sandboxes", total=total)
        while True:
            finished = sum(int(r["done"]) + int(r["dead"]) for r in q.status())
            progress.update(task, completed=finished)
            if finished >= total:
                break
            runner.join(timeout=0.25)
    elapsed = time.perf_counter() - t0
    worker.stop()
    runner.join()
    crm_server.shutdown()
    crm_server.server_close()
    _print_summary(_rows(db), elapsed, whale_jobs)
    _print_sandboxes(executor.name)
    q.close()
    console.print(f"\nLook around: [bold]TENANTQ_SCHEMA={schema} .venv/bin/tenantq dashboard[/] "
                  "(then open http://127.0.0.1:8080/) · "
                  f"[bold]TENANTQ_SCHEMA={schema} .venv/bin/tenantq status[/] · "
                  f"[bold]TENANTQ_SCHEMA={schema} .venv/bin/tenantq dead list[/]")


def _print_sandboxes(driver: str) -> None:
    if driver == "inline":
        return
    starts = {origin: int(metrics.SANDBOX_STARTS.labels(driver, origin)._value.get())
              for origin in ("cold", "template", "hibernated", "warm")}
    console.print("sandboxes: " + ", ".join(f"{n} {origin}" for origin, n in starts.items() if n)
                  + " (template = restored from the app's warm snapshot; warm = the tenant's kept sandbox)")


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
    whale = [r for r in rows if r["tenant_id"] == "whale" and r["latency"] is not None]
    span = max(float(r["latency"]) for r in whale) if whale else elapsed
    console.print(f"drained {len(rows)} jobs in {elapsed:.1f}s; the whale's {whale_jobs} rows ran at "
                  f"{whale_jobs / span:,.0f} rows/s while the small tenants were served first")
    reports = [r["result"] for r in rows if r["kind"] == "demo.render_report" and r["result"]]
    own = sum(bool(r.get("api_key_is_mine")) and r.get("secrets_seen") == ["API_KEY"] for r in reports)
    console.print(f"secrets: {own} of {len(reports)} reports saw exactly one secret, their own tenant's")
    transform = next((r for r in rows if r["kind"] == "tenantq.python"), None)
    if transform is not None:
        if transform["status"] == "done":
            console.print(f"initech's own transform ran sandboxed: result {transform['result']}")
        else:
            console.print(f"initech's own transform was refused: {str(transform['last_error'])[:80]}")
    for r in rows:
        if r["kind"] in ("demo.push_crm", "demo.exfiltrate") and r["result"]:
            for target, outcome in ({"its CRM": r["result"]["crm"]} if "crm" in r["result"]
                                    else r["result"]).items():
                console.print(f"egress: {r['tenant_id']} -> {target}: {outcome}")
    dead = [r for r in rows if r["status"] == "dead"]
    if dead:
        console.print(f"[bold]{len(dead)} poison job(s) contained in the dead-letter list:[/]")
        for r in dead:
            console.print(f"  {r['tenant_id']} {r['kind']}: {str(r['last_error']).splitlines()[0][:90]}")


if __name__ == "__main__":
    main()
