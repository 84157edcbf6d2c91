"""Host functions: the round trip of `ctx.call` (docs/tenant-data.md) from an
inline handler, from a bubblewrap sandbox (`process`) and from a gVisor one
(`gvisor`), p50/p99, for a trivial host function (`hostfnbench.noop`: an
empty object back) and a realistic one (`hostfnbench.orders`: a tenant-scoped
`SELECT ... LIMIT 100` of 100 rows through `ctx.db()`), beside the same
SELECT run directly with psycopg from the host in the same settings (a
transaction that sets the tenant with set_config, `SET LOCAL ROLE` to the
same non-owner role, the same login role, FORCE ROW LEVEL SECURITY).

Every mode goes through the real code path: a `Worker` (`once=True`) over a
scratch queue schema with the real executor (`InlineExecutor`, or
`SandboxExecutor` on `ProcessDriver` / `GVisorDriver`, cold sandboxes) and
the worker's `AppDatabase` on the same Postgres server. The timing is
guest-side: the handler (bench/host_functions_app.py) calls the function
`n` times in a loop with `time.perf_counter` around each `ctx.call` where it
runs (in the sandbox, or in the dispatcher for inline) and returns the
durations; the first `warmup` calls of each job are dropped (first imports,
the guest's first connect, the pool's first use). Interleaved: each round
runs one batch per mode (inline, process, gvisor) and then the direct
SELECTs, so drift in the machine's load hits every mode alike.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from rich.console import Console
from rich.table import Table

import tenantq
from bench.common import machine_info, save, scratch_schema
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.executors.sandboxed import SandboxExecutor
from tenantq.dispatch.executors.warm import WarmPolicy
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.errors import TenantqError
from tenantq.registry import REGISTRY
from tenantq.sandbox.drivers import bwrap_works, runsc_works
from tenantq.sandbox.drivers.gvisor import GVisorDriver
from tenantq.sandbox.drivers.process import ProcessDriver
from tenantq.store.db import Database
from tenantq.tenant_data import AppDatabase, AppDatabaseConfig

console = Console(width=160)
APP = "bench.host_functions_app"
MODES = ("inline", "process", "gvisor")
DIRECT = "direct"
FUNCTIONS = {"noop": "trivial: hostfnbench.noop -> {}",
             "orders": "SELECT 100 rows: hostfnbench.orders"}
TENANTS = ("acme", "globex", "initech", "umbrella", "hooli")
TENANT = "acme"  # the tenant whose jobs run
SETTING = "app.current_tenant_id"
# tries of a batch that does not complete (one_batch)
ATTEMPTS = 3


@dataclass(frozen=True)
class AppSchema:
    """The bench's application database: an orders table under FORCE ROW
    LEVEL SECURITY, a NOLOGIN reader (`--app-db-role`) and the LOGIN role
    the worker and the direct SELECT connect as; neither owns the table."""

    schema: str
    reader: str
    login: str
    login_url: str


def create_app_schema(dsn: str, tenants: int, rows_per_tenant: int) -> AppSchema:
    tag = uuid.uuid4().hex[:10]
    app = AppSchema(f"bench_hostfn_{tag}", f"bench_hostfn_reader_{tag}", f"bench_hostfn_login_{tag}",
                    make_conninfo(dsn, user=f"bench_hostfn_login_{tag}"))
    ident = sql.Identifier
    orders = sql.SQL("{}.orders").format(ident(app.schema))
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in (
                sql.SQL("CREATE SCHEMA {}").format(ident(app.schema)),
                sql.SQL("CREATE TABLE {} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                        "tenant_id text NOT NULL, customer text NOT NULL, amount_cents integer NOT NULL, "
                        "status text NOT NULL, created_at timestamptz NOT NULL)").format(orders),
                sql.SQL("CREATE INDEX ON {} (tenant_id, id)").format(orders),
                sql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(orders),
                sql.SQL("ALTER TABLE {} FORCE ROW LEVEL SECURITY").format(orders),
                sql.SQL("CREATE POLICY tenant_rows ON {} USING (tenant_id = current_setting({}, true)) "
                        "WITH CHECK (tenant_id = current_setting({}, true))").format(
                    orders, sql.Literal(SETTING), sql.Literal(SETTING)),
                sql.SQL("CREATE ROLE {} NOLOGIN").format(ident(app.reader)),
                sql.SQL("CREATE ROLE {} LOGIN").format(ident(app.login)),
                sql.SQL("GRANT {} TO {}").format(ident(app.reader), ident(app.login)),
            ):
                conn.execute(statement)
            for role in (app.reader, app.login):
                conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(ident(app.schema), ident(role)))
                conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(orders, ident(role)))
            # as the superuser, which RLS never covers: every tenant's rows
            conn.execute(sql.SQL(
                "INSERT INTO {} (tenant_id, customer, amount_cents, status, created_at) "
                "SELECT t, 'customer-' || (g %% 97), (g * 37) %% 100000, (ARRAY['paid', 'open', 'refunded'])"
                "[1 + g %% 3], now() - g * interval '1 minute' "
                "FROM unnest(%s::text[]) AS t, generate_series(1, %s) AS g").format(orders),
                (list(TENANTS[:tenants]), rows_per_tenant))
            conn.execute(sql.SQL("ANALYZE {}").format(orders))
    except BaseException:
        drop_app_schema(dsn, app)
        raise
    return app


def drop_app_schema(dsn: str, app: AppSchema) -> None:
    ident = sql.Identifier
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident(app.schema)))
        for role in (app.login, app.reader):
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            if exists:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(ident(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(ident(role)))


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def available_modes() -> tuple[list[str], dict[str, str]]:
    """The modes that run here, and why the others do not."""
    skipped: dict[str, str] = {}
    if not bwrap_works():
        skipped["process"] = "bubblewrap is not installed or does not work here (bwrap_works() is False)"
    if not runsc_works():
        skipped["gvisor"] = "runsc is not installed or does not work here (runsc_works() is False)"
    return [m for m in MODES if m not in skipped], skipped


def _executor(mode: str, data_dir: Path, app_db: AppDatabase) -> Any:
    if mode == "inline":
        return InlineExecutor(REGISTRY, app_db=app_db)
    driver = GVisorDriver(data_dir) if mode == "gvisor" else ProcessDriver(data_dir)
    # cold sandboxes, no template: the start-up is not what is timed
    return SandboxExecutor(driver, REGISTRY, APP, policy=WarmPolicy(snapshots=False), app_db=app_db)


def one_batch(db: Database, queue: Queue, mode: str, data_dir: Path, app_db: AppDatabase,
              calls: dict[str, int], retries: list[str]) -> dict[str, dict[str, Any]]:
    """One batch of one job per function on a fresh `worker --once` of this
    mode: each job's result (its durations, the rows its last call got).
    A batch that does not complete is run again with new jobs, up to
    ATTEMPTS times in all (on a loaded machine a sandbox can fail to start),
    each failure printed and kept in `retries`: the run fails only when
    every attempt did, so a real defect still stops it."""
    from bench.host_functions_app import KIND, NOOP, ORDERS

    names = {"noop": NOOP, "orders": ORDERS}
    for attempt in range(1, ATTEMPTS + 1):
        ids = queue.enqueue_many([JobSpec(TENANT, KIND, {"function": names[f], "n": n}, max_attempts=1)
                                  for f, n in calls.items()])
        worker = Worker(db, _executor(mode, data_dir, app_db),
                        WorkerConfig(concurrency=1, batch_size=len(ids), once=True))
        try:
            problem = f"worker: {worker.run().snapshot()}"
        except TenantqError as exc:
            problem = f"worker failed: {exc}"
        jobs = dict(zip(calls, (queue.job(i) for i in ids), strict=True))
        if all(j.status == "done" for j in jobs.values()):
            return {f: j.result for f, j in jobs.items()}
        for job_id in ids:  # a job left pending must not join the next attempt's batch
            queue.cancel(job_id)
        ended = "; ".join(f"the {f} job {j.status}: {(j.last_error or '-').splitlines()[0][:300]}"
                          for f, j in jobs.items() if j.status != "done")
        note = f"{mode}: attempt {attempt} of {ATTEMPTS} did not complete: {ended} ({problem})"
        console.print(f"[yellow]{note}")
        retries.append(note)
    raise RuntimeError(f"{mode}: no attempt of the batch completed; the last: {retries[-1]}")


def direct_selects(conn: psycopg.Connection[Any], app: AppSchema, n: int) -> tuple[list[float], int]:
    """The same SELECT from the host, `n` times, each in the transaction
    ctx.db() opens (tenant_data.py: set_config of the tenant and the actor,
    SET LOCAL ROLE), on one open connection."""
    from bench.host_functions_app import select_orders

    query = select_orders(app.schema)
    role = sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(app.reader))
    seconds: list[float] = []
    rows: list[Any] = []
    for _ in range(n):
        started = time.perf_counter()
        with conn.transaction():
            conn.execute("SELECT set_config(%s, %s, true), set_config(%s, %s, true)",
                         (SETTING, TENANT, "app.current_actor", ""))
            conn.execute(role)
            rows = conn.execute(query).fetchall()
        seconds.append(time.perf_counter() - started)
    return seconds, len(rows)


def run(*, rounds: int = 20, trivial_calls: int = 500, select_calls: int = 200, warmup: int = 5,
        tenants: int = 5, rows_per_tenant: int = 2_000) -> dict[str, Any]:
    import bench.host_functions_app as hostfn_app

    if not 0 <= warmup < min(trivial_calls, select_calls):
        raise ValueError("warmup must be fewer than the calls of each job")
    if max(trivial_calls, select_calls) > hostfn_app.MAX_CALLS:
        raise ValueError(f"at most {hostfn_app.MAX_CALLS} calls per job")
    if rows_per_tenant < 100:
        raise ValueError("rows_per_tenant must be at least 100: the SELECT returns 100 rows")
    modes, skipped = available_modes()
    for mode, reason in skipped.items():
        console.print(f"[yellow]{mode}: skipped: {reason}")
    calls = {"noop": trivial_calls, "orders": select_calls}
    per_batch = InlineExecutor(REGISTRY).call_limits.calls_per_batch
    if sum(calls.values()) > per_batch:
        raise ValueError(f"{sum(calls.values())} calls per batch exceed the batch limit of {per_batch} "
                         "(TENANTQ_HOST_CALLS_PER_BATCH)")
    load_before = os.getloadavg()
    base = Database.resolve(None)
    app = create_app_schema(base.dsn, tenants, rows_per_tenant)
    hostfn_app.SCHEMA = app.schema
    data_dir = Path(tempfile.mkdtemp(prefix="tenantq-bench-hostfn-"))
    samples: dict[str, dict[str, list[float]]] = {f: {} for f in FUNCTIONS}
    rows: dict[str, dict[str, set[int]]] = {f: {} for f in FUNCTIONS}
    retries: list[str] = []
    started = time.perf_counter()
    try:
        with scratch_schema("bench_hostfnq") as db, \
                AppDatabase(AppDatabaseConfig(url=app.login_url, role=app.reader)).open() as app_db, \
                psycopg.connect(app.login_url, autocommit=True, prepare_threshold=None) as direct:
            queue = Queue(db.dsn, schema=db.schema)
            try:
                info = machine_info(db)
                for _ in range(rounds):
                    for mode in modes:
                        results = one_batch(db, queue, mode, data_dir, app_db, calls, retries)
                        for function, result in results.items():
                            samples[function].setdefault(mode, []).extend(result["seconds"][warmup:])
                            rows[function].setdefault(mode, set()).add(int(result["rows"]))
                    seconds, count = direct_selects(direct, app, select_calls)
                    samples["orders"].setdefault(DIRECT, []).extend(seconds[warmup:])
                    rows["orders"].setdefault(DIRECT, set()).add(count)
            finally:
                queue.close()
    finally:
        hostfn_app.SCHEMA = None
        shutil.rmtree(data_dir, ignore_errors=True)
        drop_app_schema(base.dsn, app)
    elapsed = time.perf_counter() - started
    summary = summarise(samples, rows)
    load_after = os.getloadavg()
    _print(summary, rounds, warmup, elapsed, (load_before, load_after))
    payload = {"benchmark": "host-functions", "machine": info,
               "settings": {"rounds": rounds, "trivial_calls": trivial_calls, "select_calls": select_calls,
                            "warmup": warmup, "tenants": tenants, "rows_per_tenant": rows_per_tenant,
                            "app_schema": app.schema, "roles": [app.reader, app.login],
                            "timing": "guest-side: time.perf_counter around each ctx.call where the "
                                      "handler runs; direct: host-side around one transaction"},
               "modes": modes, "skipped": skipped, "retried_batches": retries, "summary": summary,
               "seconds": round(elapsed, 1),
               "load_average": {"before": load_before, "after": load_after},
               "samples_ms": {f: {m: [round(s * 1000, 4) for s in v] for m, v in by.items()}
                              for f, by in samples.items()},
               "tenantq": tenantq.__version__}
    console.print(f"wrote {save('host-functions', payload)}")
    return payload


def summarise(samples: dict[str, dict[str, list[float]]],
              rows: dict[str, dict[str, set[int]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per function and mode: calls, p50/p99 in ms, the ratios against
    inline (and for the SELECT against direct), the rows each call got."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for function, by_mode in samples.items():
        stats = {mode: (statistics.median(s), _pct(s, 0.99)) for mode, s in by_mode.items()}
        out[function] = {}
        for mode, values in by_mode.items():
            p50, p99 = stats[mode]
            entry: dict[str, Any] = {"calls": len(values), "p50_ms": p50 * 1000, "p99_ms": p99 * 1000,
                                     "rows": sorted(rows[function][mode])}
            for against in ("inline", DIRECT):
                if against in stats and against != mode:
                    entry[f"p50_vs_{against}"] = p50 / stats[against][0]
                    entry[f"p99_vs_{against}"] = p99 / stats[against][1]
            out[function][mode] = entry
    return out


def _ratio(entry: dict[str, Any], key: str) -> str:
    return f"{entry[key]:.2f}x" if key in entry else ""


def _print(summary: dict[str, dict[str, dict[str, Any]]], rounds: int, warmup: int, elapsed: float,
           load: tuple[tuple[float, ...], tuple[float, ...]]) -> None:
    table = Table(title=f"host function round trip, ms: guest-side time.perf_counter around ctx.call "
                        f"({rounds} rounds interleaved, first {warmup} calls of each job dropped); "
                        "direct: the same SELECT from the host")
    for col in ("function", "mode", "calls", "p50", "p99", "p50 / inline", "p99 / inline",
                "p50 / direct", "p99 / direct"):
        table.add_column(col, justify="left" if col in ("function", "mode") else "right")
    for function, by_mode in summary.items():
        order = [m for m in (DIRECT, *MODES) if m in by_mode]
        for mode in order:
            e = by_mode[mode]
            table.add_row(FUNCTIONS[function], "direct psycopg (host)" if mode == DIRECT else mode,
                          f"{e['calls']:,}", f"{e['p50_ms']:.3f}", f"{e['p99_ms']:.3f}",
                          _ratio(e, "p50_vs_inline"), _ratio(e, "p99_vs_inline"),
                          _ratio(e, "p50_vs_direct"), _ratio(e, "p99_vs_direct"))
    console.print(table)
    before, after = (", ".join(f"{x:.2f}" for x in averages) for averages in load)
    console.print(f"{elapsed:.1f} s in all; load average (1, 5, 15 min) before: {before}; after: {after}")
