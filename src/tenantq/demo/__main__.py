"""`python -m tenantq.demo` (the README's first command).

Three scenes on one sandboxed worker (gVisor where runsc works, else
bubblewrap; sandboxes restored from a warm template and kept warm per tenant):

1. deficit round robin between tenants of ONE class: a whale's import and
   small tenants' everyday work, all `default`, no caps, equal weights, with
   the isolation cases riding along (poison jobs: OOM, segfault, endless
   loop, a parse error; a tenant-supplied transform; network calls under
   per-tenant egress rules; scoped secrets); their waits next to the FIFO
   wait computed from the same rows;
2. the interactive reservation: interactive reports arriving while the
   whale's bulk import holds every slot;
3. tenant data through a host function: each tenant's sandboxed monthly
   report reads its orders with `ctx.call("orders.for_month", ...)`, which
   runs in the dispatcher against an `orders` table under FORCE ROW LEVEL
   SECURITY (demo/appdb.py, in the same Postgres); mallory's own code tries
   to read acme's orders and each try fails or sees only mallory's rows.

Every table has legend lines saying what each number measures. The closing
lines say where Postgres is and, for the embedded one, how to stop it.
"""

from __future__ import annotations

import logging
import threading
import time

import click
import psycopg
from psycopg import sql as pgsql
from rich.console import Console

from tenantq import Queue
from tenantq.demo import appdb, scene_fair, scene_reports, scene_reserve, workload
from tenantq.demo.report import closing_lines, embedded_running, sandboxes_line
from tenantq.demo.stage import Stage
from tenantq.dispatch.build import build_worker
from tenantq.dispatch.executors.warm import WarmPolicy
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import WorkerConfig
from tenantq.egress.config import EgressConfig
from tenantq.errors import InvalidInput, TenantqError
from tenantq.sandbox.driver import SandboxDriver
from tenantq.sandbox.drivers import get_driver
from tenantq.secrets import InjectedSecret
from tenantq.settings import Settings
from tenantq.store.db import Database
from tenantq.tenant_data import AppDatabase

APP = "tenantq.demo.handlers"


def _reset_schema(db: Database) -> None:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(db.schema)))


class _DemoSecrets:
    """Each tenant's one secret (workload.secrets_for); none injected."""

    def for_tenant(self, tenant: str) -> dict[str, str]:
        return workload.secrets_for(tenant)

    def injected(self, tenant: str) -> tuple[InjectedSecret, ...]:
        return ()


def _sandbox(console: Console, sandbox: str,
             settings: Settings) -> tuple[SandboxDriver | str, tuple[str, ...]]:
    """The sandbox driver and the poison jobs it can contain; without a
    working sandbox, "inline" and only the harmless poison job."""
    try:
        driver, chosen = get_driver(sandbox, settings.data_dir)
    except InvalidInput as exc:
        # a segfault or an endless loop would take this process: leave them out
        console.print(f"[bold red]{exc}[/]\nRunning inline instead: fairness is shown, isolation is not; "
                      "the segfault, endless-loop and OOM jobs and the network calls are left out.")
        return "inline", ("demo.parse_invoice",)
    console.print(chosen)
    return driver, workload.POISON


def _app_database(console: Console, db: Database) -> AppDatabase | None:
    """Scene 3's app database, (re)created and opened; None (the scene is
    left out, with the reason) where the demo's user may not create it."""
    try:
        return AppDatabase(appdb.create(db.dsn, db.schema)).open()
    except TenantqError as exc:
        console.print(f"[bold red]{exc}[/]\nScene 3 (tenant data through a host function) is left out.")
        return None


@click.command()
@click.option("--whale-jobs", default=1200, show_default=True, help="Rows in the whale's import (scene 1).")
@click.option("--small-jobs", default=10, show_default=True, help="Reports per small tenant (scene 1).")
@click.option("--concurrency", default=4, show_default=True)
@click.option("--batch-size", default=20, show_default=True)
@click.option("--sandbox", type=click.Choice(["auto", "gvisor", "process"]), default="auto",
              show_default=True)
@click.option("--schema", default="tenantq_demo", show_default=True,
              help="Schema the demo (re)creates; your own tenantq schema is untouched.")
def main(whale_jobs: int, small_jobs: int, concurrency: int, batch_size: int, sandbox: str,
         schema: str) -> None:
    started = time.perf_counter()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    settings = Settings()
    # Database.resolve: TENANTQ_DATABASE_URL, else the embedded server (started if needed)
    was_running = not settings.database_url and embedded_running(settings.data_dir)
    db = Database.resolve(schema=schema)
    console.print(f"[bold]tenantq demo[/] on {db.dsn.split('@')[-1]} (schema {schema})")
    _reset_schema(db)
    app_db = _app_database(console, db)
    driver, poison = _sandbox(console, sandbox, settings)
    q = Queue(db.dsn, schema=schema)
    q.migrate()
    crm = workload.CRMServer()
    # acme may reach its CRM, mallory only its own API; every other tenant: no network
    q.set_tenant("acme", egress=f"127.0.0.1:{crm.port}")
    q.set_tenant(workload.HOSTILE, egress="api.mallory.example")
    # `app_db`: scene 3's app database, for the host functions (which run
    # here, in the dispatcher) and inline handlers; never a sandbox's
    worker = build_worker(db, app=APP, sandbox=driver, config=WorkerConfig(
        concurrency=concurrency, batch_size=batch_size, poll_seconds=0.2,
        backoff=Backoff(base_seconds=0.2, cap_seconds=1.0)), policy=WarmPolicy(keep_warm_seconds=30),
        egress=EgressConfig(allow_networks=("127.0.0.1/32",)), app_db=app_db, secrets=_DemoSecrets())
    executor = worker.executor
    sandboxed = executor.name != "inline"
    runner = threading.Thread(target=worker.run, name="tenantq-demo-worker", daemon=True)
    runner.start()
    stage = Stage(db=db, q=q, worker=worker, console=console, concurrency=concurrency,
                  batch_size=batch_size, driver=executor.name)
    setup = time.perf_counter() - started
    try:
        fair, _ = scene_fair.run(stage, whale_jobs=whale_jobs, reports=small_jobs, poison=poison,
                                 crm=crm.url if sandboxed else None)
        console.print()
        scene_reserve.run(stage, seconds_per_row=fair.seconds_per_row, start_row=whale_jobs)
        if app_db is not None:
            console.print()
            app_schema, reader = appdb.names(schema)
            scene_reports.run(stage, app_schema=app_schema, reader=reader)
    finally:
        worker.stop()
        runner.join()
        crm.close()
        q.close()
        # after the worker: its last host-function calls may still hold a connection
        if app_db is not None:
            app_db.close()
    console.print()
    line = sandboxes_line(executor.name)
    if line:
        console.print(line)
    total = time.perf_counter() - started
    console.print(f"demo took {total:.1f} s ({total - setup:.1f} s after setup)")
    for line in closing_lines(settings, schema, embedded_was_running=was_running):
        console.print(line, soft_wrap=True, highlight=False)


if __name__ == "__main__":
    main()
