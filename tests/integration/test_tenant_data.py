"""`ctx.db()` (docs/tenant-data.md): an inline handler's connection to the
application's database is scoped to its job's tenant and actor, and a real
row-level-security schema (FORCE ROW LEVEL SECURITY, a role that is neither
superuser nor owner) shows it: each tenant's handler sees and writes only
its rows, whatever it asks for; nothing one job sets on its session reaches
the next job on the same pooled connection; the pool bounds the
connections however many slots run."""

from __future__ import annotations

import logging
import subprocess
import threading
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from psycopg import sql

import tenantq
from tenantq import JobSpec, Queue
from tenantq.errors import InvalidInput, TenantqError
from tenantq.registry import Registry
from tenantq.store.db import Database
from tenantq.tenant_data import APPLICATION_NAME, AppDatabase, AppDatabaseConfig
from tenantq.testing import drain
from tests.appdb import ROWS, AppSchema


def _handlers(schema: str) -> Registry:
    reg = Registry()
    orders = sql.SQL("SELECT id FROM {}.orders ORDER BY id").format(sql.Identifier(schema))
    insert = sql.SQL("INSERT INTO {}.orders VALUES (%s, %s, 0)").format(sql.Identifier(schema))
    context = ("SELECT current_setting('app.current_tenant_id', true), "
               "current_setting('app.current_actor', true), current_user, pg_backend_pid()")

    def seen(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        tenant, actor, user, pid = conn.execute(context).fetchone() or (None, None, None, None)
        return {"ids": [r[0] for r in conn.execute(orders).fetchall()], "tenant": tenant, "actor": actor,
                "user": user, "pid": pid}

    @tenantq.handler("td.orders", isolation="inline", registry=reg)
    def read_orders(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
        with ctx.db() as conn:
            return seen(conn)

    @tenantq.handler("td.snoop", isolation="inline", registry=reg)
    def snoop(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
        """Asks for another tenant's rows by id and by tenant_id, then writes one of its rows."""
        with ctx.db() as conn:
            by_tenant = conn.execute(sql.SQL("SELECT id FROM {}.orders WHERE tenant_id = %s").format(
                sql.Identifier(schema)), (payload["other"],)).fetchall()
            by_id = conn.execute(sql.SQL("SELECT id FROM {}.orders WHERE id = ANY(%s)").format(
                sql.Identifier(schema)), (payload["ids"],)).fetchall()
            assert by_tenant == [] and by_id == [], (by_tenant, by_id)
            conn.execute(insert, (payload["new_id"], payload["other"]))
        return {"wrote": True}

    @tenantq.handler("td.leave", isolation="inline", registry=reg)
    def leave_state(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
        """Sets session-level (not transaction-level) state on its connection."""
        with ctx.db() as conn:
            conn.execute("SELECT set_config('app.current_tenant_id', 'globex', false)")
            conn.execute("SET app.current_actor = 'usr_forged'")
            conn.execute("CREATE TEMP TABLE tq_left (x int)")
            conn.execute("PREPARE tq_left_stmt AS SELECT 1")
            return seen(conn)

    @tenantq.handler("td.after", isolation="inline", registry=reg)
    def after(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
        with ctx.db() as conn:
            out = seen(conn)
            out["temp"] = conn.execute("SELECT to_regclass('pg_temp.tq_left') IS NOT NULL").fetchone()
            out["prepared"] = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
            return out

    @tenantq.handler("td.async", isolation="inline", registry=reg)
    async def read_async(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
        async with ctx.db() as conn:
            rows = (await conn.execute(orders)).fetchall()
            tenant = await conn.run(lambda c: (c.execute(context).fetchone() or [None])[0])
            return {"ids": [r[0] for r in rows], "tenant": tenant}

    @tenantq.handler("td.hold", isolation="inline", registry=reg)
    def hold(payload: Any, ctx: tenantq.JobContext) -> int:
        with ctx.db() as conn:
            conn.execute("SELECT pg_sleep(0.15)")  # the job's own work, holding its connection
            return len(conn.execute(orders).fetchall())

    return reg


def _run(db: Database, reg: Registry, config: AppDatabaseConfig | None, specs: list[JobSpec],
         concurrency: int = 1) -> dict[int, Any]:
    with Queue(db.dsn, schema=db.schema) as q:
        ids = q.enqueue_many(specs)
        if config is None:
            drain(db, reg, concurrency=concurrency)
        else:
            with AppDatabase(config) as app_db:
                drain(db, reg, concurrency=concurrency, app_db=app_db)
        return {job_id: q.job(job_id) for job_id in ids}


def test_each_tenants_handler_sees_only_its_rows_and_its_actor(db: Database, app_schema: AppSchema) -> None:
    reg = _handlers(app_schema.schema)
    specs = [JobSpec(tenant="acme", kind="td.orders", actor="usr_99182"),
             JobSpec(tenant="globex", kind="td.orders"), JobSpec(tenant="initech", kind="td.orders")]
    for config in (app_schema.config(),  # a login role of its own
                   AppDatabaseConfig(url=app_schema.superuser_url, role=app_schema.reader)):  # SET LOCAL ROLE
        jobs = list(_run(db, reg, config, specs).values())
        assert [j.status for j in jobs] == ["done"] * 3, [j.last_error for j in jobs]
        acme, globex, initech = (j.result for j in jobs)
        assert (acme["ids"], acme["tenant"], acme["actor"]) == (ROWS["acme"], "acme", "usr_99182")
        assert (globex["ids"], globex["tenant"], globex["actor"]) == (ROWS["globex"], "globex", "")
        assert initech["ids"] == [] and initech["tenant"] == "initech"
        assert {acme["user"], globex["user"]} == {config.role or app_schema.login}


def test_asking_for_another_tenants_rows_gets_none_and_writing_them_fails(
        db: Database, app_schema: AppSchema, server_dsn: str) -> None:
    reg = _handlers(app_schema.schema)
    specs = [JobSpec(tenant="acme", kind="td.snoop", max_attempts=1,
                     payload={"other": "globex", "ids": ROWS["globex"], "new_id": 99}),
             JobSpec(tenant="globex", kind="td.orders")]
    jobs = list(_run(db, reg, app_schema.config(), specs).values())
    snoop, globex = jobs
    assert snoop.status == "dead" and "row-level security" in (snoop.last_error or ""), snoop.last_error
    assert globex.status == "done" and globex.result["ids"] == ROWS["globex"]
    with psycopg.connect(server_dsn) as conn:  # the refused write left nothing
        assert conn.execute(sql.SQL("SELECT count(*) FROM {}.orders WHERE id = 99").format(
            sql.Identifier(app_schema.schema))).fetchone() == (0,)


def test_session_state_a_job_leaves_never_reaches_the_next_job(db: Database, app_schema: AppSchema) -> None:
    reg = _handlers(app_schema.schema)
    specs = [JobSpec(tenant="acme", kind="td.leave"), JobSpec(tenant="acme", kind="td.after")]
    # one connection in the pool: the second job gets the first one's connection
    left, after = _run(db, reg, app_schema.config(pool_size=1), specs).values()
    assert left.status == after.status == "done", (left.last_error, after.last_error)
    assert left.result["pid"] == after.result["pid"], "not the same pooled connection: proves nothing"
    assert (after.result["tenant"], after.result["actor"], after.result["ids"]) == ("acme", "", ROWS["acme"])
    assert after.result["temp"] == [False] and after.result["prepared"] == [0]


def test_async_handlers_get_the_same_scoped_connection(db: Database, app_schema: AppSchema) -> None:
    reg = _handlers(app_schema.schema)
    job, = _run(db, reg, app_schema.config(), [JobSpec(tenant="globex", kind="td.async")]).values()
    assert job.status == "done", job.last_error
    assert job.result == {"ids": ROWS["globex"], "tenant": "globex"}


def test_without_an_app_database_ctx_db_is_a_clear_error(db: Database, app_schema: AppSchema) -> None:
    reg = _handlers(app_schema.schema)
    job, = _run(db, reg, None, [JobSpec(tenant="acme", kind="td.orders", max_attempts=1)]).values()
    assert job.status == "dead"
    assert (job.last_error or "").startswith(
        "NoAppDatabase: ctx.db(): this worker has no application database")


def test_the_pool_bounds_the_connections_however_many_slots_run(db: Database, app_schema: AppSchema,
                                                                server_dsn: str) -> None:
    reg = _handlers(app_schema.schema)
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            while not stop.is_set():
                # this test's own pool: its login role (other tests' pools share the name)
                row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                                   "AND usename = %s", (APPLICATION_NAME, app_schema.login)).fetchone()
                seen.append(int(row[0]) if row else 0)
                stop.wait(0.01)  # the sampling interval, until the drain ends

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        specs = [JobSpec(tenant=f"t{n % 6}", kind="td.hold") for n in range(24)]
        jobs = _run(db, reg, app_schema.config(pool_size=2), specs, concurrency=6).values()
    finally:
        stop.set()
        watcher.join()
    assert all(j.status == "done" for j in jobs), [j.last_error for j in jobs]
    assert seen and max(seen) == 2, f"app-database connections seen: max {max(seen, default=0)}"


def test_a_role_that_bypasses_rls_is_warned_about(app_schema: AppSchema,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tenantq.tenant_data"):
        with AppDatabase(AppDatabaseConfig(url=app_schema.superuser_url)) as app_db:
            assert app_db.bypasses_rls is True
        with AppDatabase(app_schema.config()) as app_db:
            assert app_db.bypasses_rls is False
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "bypasses row-level security" in warnings[0], warnings


@pytest.mark.parametrize(("change", "message"), [
    ({"tenant_setting": "tenant"}, "the tenant setting name must look like prefix.name"),
    ({"actor_setting": "app.x; DROP TABLE t"}, "the actor setting name must look like prefix.name"),
    ({"actor_setting": "app.current_tenant_id"}, "the tenant and actor settings must differ"),
    ({"role": "reader; RESET ROLE"}, "--app-db-role must be an SQL identifier"),
    ({"pool_size": 0}, "the application database pool size must be 1-1000"),
    ({"url": " "}, "the application database URL is empty"),
])
def test_bad_configuration_is_one_line(change: dict[str, Any], message: str) -> None:
    base = AppDatabaseConfig(url="postgresql://127.0.0.1/app")
    with pytest.raises(InvalidInput, match="^" + message):
        replace(base, **change)


def test_a_role_the_connection_cannot_take_is_refused_at_start(app_schema: AppSchema) -> None:
    refused = r"^the application database refused the tenant context: permission denied to set role"
    with pytest.raises(TenantqError, match=refused):
        AppDatabase(app_schema.config(role=app_schema.reader)).open()  # the login role is not its member


def test_the_worker_takes_app_db_and_says_in_one_line_when_it_cannot_connect(
        cli_env: dict[str, str], tenantq_cmd: list[str]) -> None:
    env = {**cli_env, "TENANTQ_APP_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=1"}
    res = subprocess.run([*tenantq_cmd, "worker", "--app", "tests.apps.basic", "--sandbox", "inline",
                          "--once"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 1
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "error: cannot connect to the application database (TENANTQ_APP_DATABASE_URL / --app-db): "
        "connection failed: "), res.stderr
