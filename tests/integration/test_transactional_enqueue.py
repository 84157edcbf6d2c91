"""`enqueue(..., conn=...)` and `enqueue_many(..., conn=...)` write in the
caller's open transaction, for every connection type tenantq accepts:
psycopg Connection / AsyncConnection, SQLAlchemy Connection / Session /
AsyncConnection / AsyncSession (postgresql+psycopg), and Django's
`connection` inside `transaction.atomic()` (savepoints included; run in a
child process, see the Django section).

Each test is an app with a schema of its own, `app_*`: the caller's
search_path is that schema only. Besides the app's business table
(`orders`) it holds decoy tables named like tenantq's (`jobs`, `tenants`,
`queues`, and a `queue_kinds` function), shaped so that an unqualified
tenantq statement would succeed against them. So every test also proves
that tenantq wrote to its own schema, never to the decoys, and left the
caller's search_path (and every other setting) as it was.

Commit: the business row and the job both exist, and a LISTEN on
`Database.notify_channel` is notified, only after the commit. Rollback:
neither row, no job, no tenants or queues row for the (fresh) tenant, and
no notification."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

import tenantq
from tenantq import AsyncQueue, JobSpec, Queue
from tenantq.store import enqueue, wakes
from tenantq.store.db import Database
from tests.conftest import ROOT

sqlalchemy = pytest.importorskip("sqlalchemy")
pytest.importorskip("django")

from sqlalchemy import orm  # noqa: E402
from sqlalchemy.ext import asyncio as sa_asyncio  # noqa: E402
from sqlalchemy.pool import NullPool  # noqa: E402

KIND = "orders.confirm"
ACTOR = "usr_1"
META = {"request_id": "r-1", "plan": "pro"}

DECOYS = """
CREATE TABLE {s}.orders (id bigserial PRIMARY KEY, note text NOT NULL UNIQUE);
CREATE TABLE {s}.tenants (tenant_id text PRIMARY KEY, weight integer, max_sandboxes integer);
CREATE TABLE {s}.queues (tenant_id text, priority text, has_work boolean, next_run_at timestamptz,
                         kinds text[], kinds_due timestamptz, PRIMARY KEY (tenant_id, priority));
CREATE TABLE {s}.wakes (tenant_id text, priority text, kind text, run_after timestamptz);
CREATE TABLE {s}.jobs (id bigserial PRIMARY KEY, tenant_id text, kind text, payload jsonb, priority text,
                       max_attempts integer, run_after timestamptz, idempotency_key text,
                       created_at timestamptz, actor text, meta jsonb, status text DEFAULT 'pending');
CREATE UNIQUE INDEX ON {s}.jobs (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE FUNCTION {s}.queue_kinds(a text[], b text[]) RETURNS text[] LANGUAGE sql AS 'SELECT a || b';
"""


def _fresh_tenant() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@dataclass
class App:
    """The caller's side: its schema, its LISTEN connection, and the checks."""

    schema: str
    server_dsn: str
    queue: Queue
    listen: psycopg.Connection[Any]

    @property
    def db(self) -> Database:
        return self.queue.db

    @property
    def options(self) -> str:
        return f"-c search_path={self.schema}"

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """The app's own psycopg connection: autocommit off, its own search_path."""
        return psycopg.connect(self.server_dsn, options=self.options, **kwargs)

    async def aconnect(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(self.server_dsn, options=self.options)

    def _outside(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Read committed state from a connection of nobody's."""
        with psycopg.connect(self.server_dsn, autocommit=True, row_factory=dict_row) as conn:
            return conn.execute(query.format(app=self.schema, tq=self.db.schema), params).fetchall()  # type: ignore[arg-type]

    # -- what the caller's connection shows ----------------------------------
    def check_search_path(self, shown: object) -> None:
        assert shown == self.schema, f"the caller's search_path changed: {shown!r}"
        assert self.db.schema not in str(shown)

    # -- what the rest of the world sees --------------------------------------
    def orders(self) -> list[str]:
        return [r["note"] for r in self._outside("SELECT note FROM {app}.orders ORDER BY id")]

    def decoys(self) -> dict[str, int]:
        row = self._outside("SELECT (SELECT count(*) FROM {app}.jobs) AS jobs, "
                            "(SELECT count(*) FROM {app}.tenants) AS tenants, "
                            "(SELECT count(*) FROM {app}.queues) AS queues, "
                            "(SELECT count(*) FROM {app}.wakes) AS wakes")[0]
        return {k: int(v) for k, v in row.items()}

    def tenant_rows(self, tenant: str) -> dict[str, int]:
        """What the producer wrote (its jobs and their wakes, nothing shared)."""
        row = self._outside(
            "SELECT (SELECT count(*) FROM {tq}.jobs WHERE tenant_id = %(t)s) AS jobs, "
            "(SELECT count(*) FROM {tq}.wakes WHERE tenant_id = %(t)s) AS wakes", {"t": tenant})[0]
        return {k: int(v) for k, v in row.items()}

    def folded_rows(self, tenant: str) -> dict[str, int]:
        """The tenant's rows once a worker has folded the wakes."""
        with self.db.connect() as conn:
            folded = wakes.fold(conn)
        if folded:  # the fold's own notification (for other workers): not the producer's
            assert list(self.listen.notifies(timeout=5, stop_after=1))
        row = self._outside(
            "SELECT (SELECT count(*) FROM {tq}.wakes WHERE tenant_id = %(t)s) AS wakes, "
            "(SELECT count(*) FROM {tq}.tenants WHERE tenant_id = %(t)s) AS tenants, "
            "(SELECT count(*) FROM {tq}.queues WHERE tenant_id = %(t)s) AS queues", {"t": tenant})[0]
        return {k: int(v) for k, v in row.items()}

    def notifications(self, *, timeout: float) -> list[psycopg.Notify]:
        return list(self.listen.notifies(timeout=timeout))

    def expect_notification(self) -> None:
        notes = list(self.listen.notifies(timeout=10, stop_after=1))
        assert notes, "no notification on the worker channel after the commit"
        assert notes[0].channel == self.db.notify_channel
        self.notifications(timeout=0.05)  # duplicates in one transaction may or may not fold

    # -- the three moments ---------------------------------------------------
    def in_flight(self, job_ids: list[int], tenant: str, note: str | None) -> None:
        """Inside the caller's open transaction: nobody else sees anything yet."""
        for job_id in job_ids:
            with pytest.raises(tenantq.JobNotFound):
                self.queue.job(job_id)
        assert self.tenant_rows(tenant) == {"jobs": 0, "wakes": 0}
        if note is not None:
            assert note not in self.orders()
        assert self.notifications(timeout=0.2) == [], "a worker was woken before the commit"

    def committed(self, job_ids: list[int], tenant: str, note: str | None, *,
                  actor: str | None = ACTOR, meta: dict[str, Any] | None = None) -> None:
        self.expect_notification()
        # what the producer wrote, before anything folds it (Queue.job does:
        # its explanation reads the queue row)
        rows = self.tenant_rows(tenant)
        assert rows["jobs"] == len(job_ids) and rows["wakes"] >= 1, rows
        assert self.folded_rows(tenant) == {"wakes": 0, "tenants": 1, "queues": 1}
        for job_id in job_ids:
            info = self.queue.job(job_id)
            assert (info.status, info.tenant_id, info.kind) == ("pending", tenant, KIND), info
            assert (info.actor, info.meta) == (actor, META if meta is None else meta), info
        if note is not None:
            assert note in self.orders()
        assert self.decoys() == {"jobs": 0, "tenants": 0, "queues": 0, "wakes": 0}, \
            "tenantq wrote to the caller's schema"

    def rolled_back(self, job_ids: list[int], tenant: str, note: str | None) -> None:
        for job_id in job_ids:
            with pytest.raises(tenantq.JobNotFound):
                self.queue.job(job_id)
        assert self.tenant_rows(tenant) == {"jobs": 0, "wakes": 0}
        if note is not None:
            assert note not in self.orders()
        assert self.notifications(timeout=0.3) == [], "a rolled-back enqueue woke a worker"
        assert self.decoys() == {"jobs": 0, "tenants": 0, "queues": 0, "wakes": 0}

    def finish(self, outcome: str, job_ids: list[int], tenant: str, note: str | None) -> None:
        if outcome == "commit":
            self.committed(job_ids, tenant, note)
        else:
            self.rolled_back(job_ids, tenant, note)


@pytest.fixture
def app(server_dsn: str, queue: Queue) -> Iterator[App]:
    schema = f"app_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE SCHEMA {}").format(pgsql.Identifier(schema)))
        conn.execute(DECOYS.format(s=schema))  # type: ignore[arg-type]
    listen = psycopg.connect(server_dsn, autocommit=True)
    try:
        listen.execute(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(queue.db.notify_channel)))
        yield App(schema=schema, server_dsn=server_dsn, queue=queue, listen=listen)
    finally:
        listen.close()
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(schema)))


def _session_settings(conn: psycopg.Connection[Any]) -> dict[str, str]:
    with conn.cursor() as cur:
        cur.execute("SELECT name, setting FROM pg_settings")
        return {str(name): str(setting) for name, setting in cur.fetchall()}


OUTCOMES = ["commit", "rollback"]


@pytest.fixture(params=["insert", "copy"])
def bulk_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """enqueue_many's two ways in (store/enqueue.py): one statement, or
    COPY, forced here for a small call by lowering its threshold."""
    if request.param == "copy":
        monkeypatch.setattr(enqueue, "COPY_AT", 2)
    return str(request.param)


# -- psycopg -------------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_psycopg_connection(app: App, queue: Queue, outcome: str) -> None:
    tenant, note = _fresh_tenant(), f"psycopg-{outcome}"
    # the app's connection as the app made it: tuple rows, client-side binding
    with app.connect(cursor_factory=psycopg.ClientCursor) as conn:
        conn.execute("INSERT INTO orders (note) VALUES (%s)", [note])
        before = _session_settings(conn)
        job_id = queue.enqueue(tenant, KIND, {"order": note}, actor=ACTOR, meta=META, conn=conn)
        assert isinstance(job_id, int)
        assert conn.info.transaction_status == TransactionStatus.INTRANS, "tenantq ended the transaction"
        assert _session_settings(conn) == before, "tenantq changed a setting of the caller's session"
        app.check_search_path(conn.execute("SHOW search_path").fetchone()[0])  # type: ignore[index]
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the caller's row factory is untouched
        app.in_flight([job_id], tenant, note)
        conn.commit() if outcome == "commit" else conn.rollback()
        app.check_search_path(conn.execute("SHOW search_path").fetchone()[0])  # type: ignore[index]
        conn.rollback()
    app.finish(outcome, [job_id], tenant, note)


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_psycopg_transaction_block(app: App, queue: Queue, outcome: str) -> None:
    """`with conn.transaction():` on an autocommit connection: the block is the transaction."""
    tenant, note = _fresh_tenant(), f"block-{outcome}"
    with app.connect(autocommit=True) as conn:
        job_id = 0
        with pytest.raises(ZeroDivisionError) if outcome == "rollback" else nullcontext():
            with conn.transaction():
                conn.execute("INSERT INTO orders (note) VALUES (%s)", [note])
                job_id = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, conn=conn)
                app.in_flight([job_id], tenant, note)
                if outcome == "rollback":
                    _ = 1 / 0
        app.check_search_path(conn.execute("SHOW search_path").fetchone()[0])  # type: ignore[index]
    app.finish(outcome, [job_id], tenant, note)


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_psycopg_async_connection(app: App, db: Database, outcome: str) -> None:
    tenant, note = _fresh_tenant(), f"apsycopg-{outcome}"

    async def main() -> int:
        async with AsyncQueue(db.dsn, schema=db.schema) as aq, await app.aconnect() as conn:
            await conn.execute("INSERT INTO orders (note) VALUES (%s)", [note])
            job_id = await aq.enqueue(tenant, KIND, {"order": note}, actor=ACTOR, meta=META, conn=conn)
            assert conn.info.transaction_status == TransactionStatus.INTRANS
            app.check_search_path((await (await conn.execute("SHOW search_path")).fetchone())[0])  # type: ignore[index]
            app.in_flight([job_id], tenant, note)
            await (conn.commit() if outcome == "commit" else conn.rollback())
            return job_id

    job_id = asyncio.run(main())
    app.finish(outcome, [job_id], tenant, note)


# -- SQLAlchemy, sync -------------------------------------------------------------------------


def _url(server_dsn: str) -> Any:
    params = conninfo_to_dict(server_dsn)
    return sqlalchemy.URL.create(
        "postgresql+psycopg", username=params.get("user"), password=params.get("password"),
        host=params.get("host"), port=int(params["port"]) if params.get("port") else None,
        database=params.get("dbname"))


@pytest.fixture
def engine(app: App) -> Iterator[Any]:
    engine = sqlalchemy.create_engine(_url(app.server_dsn), poolclass=NullPool,
                                      connect_args={"options": app.options})
    try:
        yield engine
    finally:
        engine.dispose()


class Base(orm.DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"  # unqualified: the app's search_path finds it

    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    note: orm.Mapped[str]


def _text(statement: str) -> Any:
    return sqlalchemy.text(statement)


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_sqlalchemy_connection(app: App, queue: Queue, engine: Any, outcome: str) -> None:
    tenant, note = _fresh_tenant(), f"sa-conn-{outcome}"
    with engine.connect() as conn:
        conn.execute(_text("INSERT INTO orders (note) VALUES (:note)"), {"note": note})
        job_id = queue.enqueue(tenant, KIND, {"order": note}, actor=ACTOR, meta=META, conn=conn)
        assert conn.in_transaction()
        app.check_search_path(conn.execute(_text("SHOW search_path")).scalar_one())
        app.in_flight([job_id], tenant, note)
        conn.commit() if outcome == "commit" else conn.rollback()
        app.check_search_path(conn.execute(_text("SHOW search_path")).scalar_one())
        conn.rollback()
    app.finish(outcome, [job_id], tenant, note)


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_sqlalchemy_connection_not_begun_yet(app: App, queue: Queue, engine: Any, outcome: str) -> None:
    """enqueue as the first statement: it begins the transaction, as SQLAlchemy's autobegin would."""
    tenant = _fresh_tenant()
    with engine.connect() as conn:
        assert not conn.in_transaction()
        job_id = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, conn=conn)
        assert conn.in_transaction()
        app.in_flight([job_id], tenant, None)
        conn.commit() if outcome == "commit" else conn.rollback()
    app.finish(outcome, [job_id], tenant, None)


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_sqlalchemy_engine_begin_block(app: App, queue: Queue, engine: Any, outcome: str) -> None:
    tenant, note = _fresh_tenant(), f"sa-begin-{outcome}"
    job_id = 0
    with pytest.raises(ZeroDivisionError) if outcome == "rollback" else nullcontext():
        with engine.begin() as conn:
            conn.execute(_text("INSERT INTO orders (note) VALUES (:note)"), {"note": note})
            job_id = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, conn=conn)
            app.in_flight([job_id], tenant, note)
            if outcome == "rollback":
                _ = 1 / 0
    app.finish(outcome, [job_id], tenant, note)


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_sqlalchemy_session(app: App, queue: Queue, engine: Any, outcome: str) -> None:
    tenant, note = _fresh_tenant(), f"sa-session-{outcome}"
    with orm.Session(engine) as session:
        session.add(Order(note=note))
        session.flush()  # the business row is written, in the session's transaction
        job_id = queue.enqueue(tenant, KIND, {"order": note}, actor=ACTOR, meta=META, conn=session)
        assert session.in_transaction()
        app.check_search_path(session.execute(_text("SHOW search_path")).scalar_one())
        app.in_flight([job_id], tenant, note)
        session.commit() if outcome == "commit" else session.rollback()
    app.finish(outcome, [job_id], tenant, note)


def test_sqlalchemy_session_unflushed_object_commits_with_the_job(app: App, queue: Queue,
                                                                  engine: Any) -> None:
    """An object added but not flushed yet: commit flushes it; both land together."""
    tenant, note = _fresh_tenant(), "sa-session-autoflush"
    with orm.Session(engine) as session, session.begin():
        session.add(Order(note=note))
        job_id = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, conn=session)
        app.in_flight([job_id], tenant, note)
    app.committed([job_id], tenant, note)


# -- SQLAlchemy, async ----------------------------------------------------------------------


def _async_engine(app: App) -> Any:
    return sa_asyncio.create_async_engine(_url(app.server_dsn), poolclass=NullPool,
                                          connect_args={"options": app.options})


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_sqlalchemy_async_connection(app: App, db: Database, outcome: str) -> None:
    tenant, note = _fresh_tenant(), f"sa-aconn-{outcome}"

    async def main() -> int:
        engine = _async_engine(app)
        try:
            async with AsyncQueue(db.dsn, schema=db.schema) as aq, engine.connect() as conn:
                await conn.execute(_text("INSERT INTO orders (note) VALUES (:note)"), {"note": note})
                job_id = await aq.enqueue(tenant, KIND, {"order": note}, actor=ACTOR, meta=META, conn=conn)
                assert conn.in_transaction()
                app.check_search_path((await conn.execute(_text("SHOW search_path"))).scalar_one())
                app.in_flight([job_id], tenant, note)
                await (conn.commit() if outcome == "commit" else conn.rollback())
                return job_id
        finally:
            await engine.dispose()

    job_id = asyncio.run(main())
    app.finish(outcome, [job_id], tenant, note)


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_sqlalchemy_async_session(app: App, db: Database, outcome: str) -> None:
    tenant, note = _fresh_tenant(), f"sa-asession-{outcome}"

    async def main() -> int:
        engine = _async_engine(app)
        try:
            async with AsyncQueue(db.dsn, schema=db.schema) as aq, sa_asyncio.AsyncSession(engine) as session:
                session.add(Order(note=note))
                await session.flush()
                job_id = await aq.enqueue(tenant, KIND, {"order": note}, actor=ACTOR, meta=META,
                                          conn=session)
                assert session.in_transaction()
                app.check_search_path((await session.execute(_text("SHOW search_path"))).scalar_one())
                app.in_flight([job_id], tenant, note)
                await (session.commit() if outcome == "commit" else session.rollback())
                return job_id
        finally:
            await engine.dispose()

    job_id = asyncio.run(main())
    app.finish(outcome, [job_id], tenant, note)


# -- Django ------------------------------------------------------------------------------------
#
# Django's settings are process-wide and configured once, and
# tests/examples/test_django_app.py needs a process in which nobody has
# configured them. So each Django scenario runs in a child Python (with
# warnings as errors): it configures Django on the test server, sets the
# app's search_path on django.db.connection, runs the scenario and its
# in-transaction checks, and prints what it did as JSON; this process
# checks what is visible after it (its LISTEN connection receives the
# child's notifications).

DJANGO_SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {}
_CHILD = ("import sys; from tests.integration.test_transactional_enqueue import _django_child; "
          "_django_child(sys.argv[1])")


def django_scenario(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    DJANGO_SCENARIOS[fn.__name__] = fn
    return fn


def run_django(app: App, scenario: str, **kwargs: Any) -> dict[str, Any]:
    spec = {"scenario": scenario, "server_dsn": app.server_dsn, "tq_schema": app.db.schema,
            "app_schema": app.schema, "kwargs": kwargs}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-W", "error", "-c", _CHILD, json.dumps(spec)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"Django scenario {scenario} failed:\n{res.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return result


def _django_setup(server_dsn: str) -> None:
    """Configure Django once per (child) process, on the test server's database."""
    import django
    from django.conf import settings

    if not settings.configured:
        params = conninfo_to_dict(server_dsn)
        settings.configure(
            DATABASES={"default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": params.get("dbname") or "postgres",
                "USER": params.get("user") or "",
                "PASSWORD": params.get("password") or "",
                "HOST": params.get("host") or "",
                "PORT": str(params.get("port") or ""),
            }},
            INSTALLED_APPS=[],
            USE_TZ=True,
        )
        django.setup()


def _django_child(spec_json: str) -> None:
    spec = json.loads(spec_json)
    _django_setup(spec["server_dsn"])
    from django.db import connection

    queue = Queue(spec["server_dsn"], schema=spec["tq_schema"])
    listen = psycopg.connect(spec["server_dsn"], autocommit=True)
    try:
        listen.execute(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(queue.db.notify_channel)))
        app = App(schema=spec["app_schema"], server_dsn=spec["server_dsn"], queue=queue, listen=listen)
        connection.ensure_connection()
        assert isinstance(connection.connection, psycopg.Connection), "Django is not on its psycopg 3 backend"
        with connection.cursor() as cur:  # autocommit outside atomic(): a session setting
            cur.execute(f"SET search_path TO {app.schema}")
        result = DJANGO_SCENARIOS[spec["scenario"]](app, queue, connection, **spec["kwargs"])
    finally:
        connection.close()
        queue.close()
        listen.close()
    print(json.dumps(result))


def _django_search_path(connection: Any) -> str:
    with connection.cursor() as cur:
        cur.execute("SHOW search_path")
        return str(cur.fetchone()[0])


def _django_order(connection: Any, note: str) -> None:
    with connection.cursor() as cur:
        cur.execute("INSERT INTO orders (note) VALUES (%s)", [note])


class Rollback(Exception):
    """What the app raises to leave an atomic() block with a rollback."""


@contextmanager
def rolls_back() -> Iterator[None]:
    """The block must end with Rollback (raised through atomic()); swallow it."""
    try:
        yield
    except Rollback:
        return
    raise AssertionError("the block did not raise Rollback")


@django_scenario
def atomic(app: App, queue: Queue, connection: Any, *, outcome: str) -> dict[str, Any]:
    from django.db import transaction

    tenant, note = _fresh_tenant(), f"django-{outcome}"
    job_id = 0
    with rolls_back() if outcome == "rollback" else nullcontext(), transaction.atomic():
        _django_order(connection, note)
        before = _session_settings(connection.connection)
        job_id = queue.enqueue(tenant, KIND, {"order": note}, actor=ACTOR, meta=META, conn=connection)
        assert connection.in_atomic_block
        assert _session_settings(connection.connection) == before, "tenantq changed a session setting"
        app.check_search_path(_django_search_path(connection))
        app.in_flight([job_id], tenant, note)
        if outcome == "rollback":
            raise Rollback
    app.check_search_path(_django_search_path(connection))
    return {"job_ids": [job_id], "tenant": tenant, "note": note}


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_django_atomic(app: App, outcome: str) -> None:
    done = run_django(app, "atomic", outcome=outcome)
    app.finish(outcome, done["job_ids"], done["tenant"], done["note"])


@django_scenario
def savepoint_rolled_back(app: App, queue: Queue, connection: Any) -> dict[str, Any]:
    from django.db import transaction

    kept_tenant, dropped_tenant = _fresh_tenant(), _fresh_tenant()
    with transaction.atomic():
        _django_order(connection, "outer")
        kept = queue.enqueue(kept_tenant, KIND, actor=ACTOR, meta=META, conn=connection)
        with rolls_back(), transaction.atomic():
            _django_order(connection, "inner")
            dropped = queue.enqueue(dropped_tenant, KIND, actor=ACTOR, meta=META, conn=connection)
            raise Rollback
        assert connection.in_atomic_block and not connection.needs_rollback
        app.in_flight([kept, dropped], kept_tenant, "outer")
    return {"kept": kept, "kept_tenant": kept_tenant, "dropped": dropped, "dropped_tenant": dropped_tenant}


def test_django_savepoint_rolled_back_outer_committed(app: App) -> None:
    """The job was enqueued in an inner atomic() (a savepoint) that rolled
    back; the outer block commits: its order and job land, the inner job never existed."""
    done = run_django(app, "savepoint_rolled_back")
    assert app.orders() == ["outer"]
    app.committed([done["kept"]], done["kept_tenant"], "outer")
    app.rolled_back([done["dropped"]], done["dropped_tenant"], "inner")


@django_scenario
def savepoint_alone_rolled_back(app: App, queue: Queue, connection: Any) -> dict[str, Any]:
    from django.db import transaction

    tenant = _fresh_tenant()
    with transaction.atomic():
        _django_order(connection, "outer-only")
        with rolls_back(), transaction.atomic():
            job_id = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, conn=connection)
            raise Rollback
    return {"job_ids": [job_id], "tenant": tenant}


def test_django_savepoint_alone_rolled_back_sends_no_notification(app: App) -> None:
    """Only the savepoint enqueued: when it rolls back, its NOTIFY goes with it."""
    done = run_django(app, "savepoint_alone_rolled_back")
    assert app.orders() == ["outer-only"]
    app.rolled_back(done["job_ids"], done["tenant"], None)


@django_scenario
def savepoint_released_outer_rolled_back(app: App, queue: Queue, connection: Any) -> dict[str, Any]:
    from django.db import transaction

    tenant = _fresh_tenant()
    with rolls_back(), transaction.atomic():
        with transaction.atomic():
            _django_order(connection, "inner-released")
            job_id = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, conn=connection)
        app.in_flight([job_id], tenant, "inner-released")
        raise Rollback
    return {"job_ids": [job_id], "tenant": tenant}


def test_django_savepoint_released_outer_rolled_back(app: App) -> None:
    done = run_django(app, "savepoint_released_outer_rolled_back")
    app.rolled_back(done["job_ids"], done["tenant"], "inner-released")


@django_scenario
def savepoint_released_outer_committed(app: App, queue: Queue, connection: Any) -> dict[str, Any]:
    from django.db import transaction

    tenant = _fresh_tenant()
    with transaction.atomic():
        outer = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, conn=connection)
        with transaction.atomic():
            _django_order(connection, "nested")
            inner = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, conn=connection)
        app.in_flight([outer, inner], tenant, "nested")
    return {"job_ids": [outer, inner], "tenant": tenant}


def test_django_savepoint_released_outer_committed(app: App) -> None:
    done = run_django(app, "savepoint_released_outer_committed")
    app.committed(done["job_ids"], done["tenant"], "nested")


@django_scenario
def broken_atomic_block(app: App, queue: Queue, connection: Any) -> dict[str, Any]:
    from django.db import IntegrityError, transaction
    from django.db.transaction import TransactionManagementError

    tenant = _fresh_tenant()
    with transaction.atomic():
        _django_order(connection, "dup")
        try:
            with transaction.atomic(savepoint=False):
                _django_order(connection, "dup")
        except IntegrityError:
            pass
        assert connection.needs_rollback
        with pytest.raises(TransactionManagementError):
            queue.enqueue(tenant, KIND, conn=connection)
    return {"tenant": tenant}


def test_django_broken_atomic_block_refuses_enqueue(app: App) -> None:
    """After an error Django marks the block for rollback; tenantq refuses
    it, as Django's own queries would."""
    done = run_django(app, "broken_atomic_block")
    app.rolled_back([], done["tenant"], "dup")


@django_scenario
def outside_atomic(app: App, queue: Queue, connection: Any) -> dict[str, Any]:
    tenant = _fresh_tenant()
    job_id = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, conn=connection)
    app.check_search_path(_django_search_path(connection))
    return {"job_ids": [job_id], "tenant": tenant}


def test_django_outside_atomic_is_autocommit(app: App) -> None:
    """Outside atomic() Django's connection autocommits, and so does the enqueue."""
    done = run_django(app, "outside_atomic")
    app.committed(done["job_ids"], done["tenant"], None)


@django_scenario
def given_to_async_queue(app: App, queue: Queue, connection: Any) -> dict[str, Any]:
    async def main() -> str:
        async with AsyncQueue(queue.db.dsn, schema=queue.db.schema) as aq:
            with pytest.raises(tenantq.InvalidInput) as caught:
                await aq.enqueue("acme", KIND, conn=connection)
            return _one_line(caught.value)

    return {"message": asyncio.run(main())}


def test_django_connection_given_to_async_queue_says_use_queue(app: App) -> None:
    done = run_django(app, "given_to_async_queue")
    assert "use tenantq.Queue" in done["message"], done
    assert app.tenant_rows("acme") == {"jobs": 0, "wakes": 0}


# -- search_path, the decoys, enqueue_many --------------------------------------------------


def test_decoy_tables_on_the_callers_search_path_stay_empty(app: App, queue: Queue) -> None:
    """Every statement of enqueue and enqueue_many (insert, the idempotency
    lookup, the kinds-hint function) names tenantq's schema: the same-named
    tables the caller's search_path finds first stay empty."""
    tenant = _fresh_tenant()
    with app.connect() as conn:
        first = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, key="k-1", conn=conn)
        # the same key again: the insert skips it and the id is looked up by key
        again = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, key="k-1", conn=conn)
        assert again == first
        many = queue.enqueue_many([JobSpec(tenant, KIND, actor=ACTOR, meta=META, key="k-1"),
                                   JobSpec(tenant, "other.kind", actor=ACTOR, meta=META),
                                   JobSpec(tenant, KIND, actor=ACTOR, meta=META, delay=60)], conn=conn)
        assert many[0] == first and len(set(many)) == 3
        app.check_search_path(conn.execute("SHOW search_path").fetchone()[0])  # type: ignore[index]
        assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)  # the caller's (decoy) jobs
        conn.commit()
    app.expect_notification()
    assert app.decoys() == {"jobs": 0, "tenants": 0, "queues": 0, "wakes": 0}
    rows = app._outside("SELECT id, kind FROM {tq}.jobs ORDER BY id")
    assert [r["id"] for r in rows] == sorted(set(many))
    app.folded_rows(tenant)
    kinds = app._outside("SELECT kinds FROM {tq}.queues WHERE tenant_id = %(t)s", {"t": tenant})
    assert sorted(kinds[0]["kinds"]) == [KIND, "other.kind"]


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_enqueue_many_with_psycopg_connection(app: App, queue: Queue, outcome: str, bulk_path: str) -> None:
    tenant, other = _fresh_tenant(), _fresh_tenant()
    with app.connect() as conn:
        conn.execute("INSERT INTO orders (note) VALUES (%s)", [f"many-{outcome}"])
        ids = queue.enqueue_many([JobSpec(tenant, KIND, {"i": 0}, actor=ACTOR, meta=META),
                                  {"tenant": tenant, "kind": KIND, "payload": {"i": 1}, "actor": ACTOR,
                                   "meta": META},
                                  JobSpec(other, KIND, {"i": 2}, actor=ACTOR, meta=META)], conn=conn)
        assert len(ids) == 3 and ids == sorted(ids)
        app.in_flight(ids, tenant, f"many-{outcome}")
        assert app.tenant_rows(other) == {"jobs": 0, "wakes": 0}
        conn.commit() if outcome == "commit" else conn.rollback()
    if outcome == "commit":
        app.committed(ids[:2], tenant, f"many-{outcome}")
        assert app.tenant_rows(other)["jobs"] == 1
        assert [queue.job(i).payload for i in ids] == [{"i": 0}, {"i": 1}, {"i": 2}]
    else:
        app.rolled_back(ids, tenant, f"many-{outcome}")
        assert app.tenant_rows(other) == {"jobs": 0, "wakes": 0}


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_enqueue_many_with_async_connection(app: App, db: Database, outcome: str, bulk_path: str) -> None:
    tenant = _fresh_tenant()

    async def main() -> list[int]:
        async with AsyncQueue(db.dsn, schema=db.schema) as aq, await app.aconnect() as conn:
            ids = await aq.enqueue_many([JobSpec(tenant, KIND, {"i": i}, actor=ACTOR, meta=META)
                                         for i in range(5)], conn=conn)
            app.in_flight(ids, tenant, None)
            await (conn.commit() if outcome == "commit" else conn.rollback())
            return ids

    ids = asyncio.run(main())
    app.finish(outcome, ids, tenant, None)


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_enqueue_many_with_sqlalchemy_async_session(app: App, db: Database, outcome: str,
                                                    bulk_path: str) -> None:
    tenant, note = _fresh_tenant(), f"sa-amany-{outcome}"

    async def main() -> list[int]:
        engine = _async_engine(app)
        try:
            async with AsyncQueue(db.dsn, schema=db.schema) as aq, sa_asyncio.AsyncSession(engine) as session:
                session.add(Order(note=note))
                await session.flush()
                ids = await aq.enqueue_many([JobSpec(tenant, KIND, {"i": i}, actor=ACTOR, meta=META)
                                             for i in range(3)], conn=session)
                app.in_flight(ids, tenant, note)
                await (session.commit() if outcome == "commit" else session.rollback())
                return ids
        finally:
            await engine.dispose()

    ids = asyncio.run(main())
    app.finish(outcome, ids, tenant, note)


@django_scenario
def atomic_many(app: App, queue: Queue, connection: Any, *, outcome: str) -> dict[str, Any]:
    from django.db import transaction

    tenant, note = _fresh_tenant(), f"django-many-{outcome}"
    ids: list[int] = []
    with rolls_back() if outcome == "rollback" else nullcontext(), transaction.atomic():
        _django_order(connection, note)
        ids = queue.enqueue_many([JobSpec(tenant, KIND, {"i": i}, actor=ACTOR, meta=META) for i in range(3)],
                                 conn=connection)
        app.in_flight(ids, tenant, note)
        if outcome == "rollback":
            raise Rollback
    return {"job_ids": ids, "tenant": tenant, "note": note}


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_enqueue_many_with_django_atomic(app: App, outcome: str) -> None:
    done = run_django(app, "atomic_many", outcome=outcome)
    app.finish(outcome, done["job_ids"], done["tenant"], done["note"])


def test_a_bad_job_in_enqueue_many_leaves_the_callers_transaction_usable(app: App, queue: Queue) -> None:
    tenant = _fresh_tenant()
    with app.connect() as conn:
        conn.execute("INSERT INTO orders (note) VALUES ('survives')")
        with pytest.raises(tenantq.InvalidInput, match="job 1") as caught:
            queue.enqueue_many([JobSpec(tenant, KIND), JobSpec(tenant, KIND, meta=["not", "an", "object"])],
                               conn=conn)
        assert "\n" not in str(caught.value)
        with pytest.raises(tenantq.InvalidInput):
            queue.enqueue(tenant, KIND, actor="bad\nactor", conn=conn)
        assert conn.info.transaction_status == TransactionStatus.INTRANS  # not aborted
        job_id = queue.enqueue(tenant, KIND, actor=ACTOR, meta=META, conn=conn)
        conn.commit()
    app.committed([job_id], tenant, "survives")


# -- the envelope: validated before anything is sent -------------------------------------------


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"k": value}
    return value


@pytest.mark.parametrize(("field", "value", "message"), [
    ("actor", "usr\n1", "control character"),
    ("actor", "usr\x001", "control character"),
    ("actor", "usr\x7f", "control character"),
    ("actor", "x" * 201, "1-200 characters"),
    ("actor", "", "1-200 characters"),
    ("actor", 42, "actor must be a string"),
    ("meta", ["not", "an", "object"], "meta must be a JSON object"),
    ("meta", "request_id=r-1", "meta must be a JSON object"),
    ("meta", {"k": "x" * 4088}, "the limit is 4096"),  # 4097 bytes as Postgres renders it
    ("meta", _nested(9), "nested 9 levels deep"),
    ("meta", {"k": float("nan")}, "meta"),
])
def test_a_bad_envelope_is_one_line_and_leaves_the_callers_transaction_usable(
        app: App, queue: Queue, field: str, value: Any, message: str) -> None:
    tenant = _fresh_tenant()
    with app.connect() as conn:
        conn.execute("INSERT INTO orders (note) VALUES ('kept')")
        with pytest.raises(tenantq.InvalidInput) as caught:
            queue.enqueue(tenant, KIND, conn=conn, **{field: value})
        assert message in _one_line(caught.value)
        with pytest.raises(tenantq.InvalidInput):
            queue.enqueue_many([{"tenant": tenant, "kind": KIND, field: value}], conn=conn)
        assert conn.info.transaction_status == TransactionStatus.INTRANS
        conn.commit()
    assert "kept" in app.orders()
    assert app.tenant_rows(tenant) == {"jobs": 0, "wakes": 0}


def test_the_largest_envelope_allowed_is_stored(app: App, queue: Queue) -> None:
    """Validation and the table's CHECKs agree at the limits: 200 characters
    of actor, 4,096 bytes of meta as Postgres renders it (UTF-8), 8 levels."""
    tenant = _fresh_tenant()
    actor = "é" * 200  # characters, not bytes
    metas = [{"k": "x" * 4087}, {"k": "é" * 2043}, _nested(8)]
    with app.connect() as conn:
        ids = [queue.enqueue(tenant, KIND, actor=actor, meta=meta, conn=conn) for meta in metas]
        conn.commit()
    app.expect_notification()
    assert [(queue.job(i).actor, queue.job(i).meta) for i in ids] == [(actor, m) for m in metas]
    sizes = app._outside("SELECT octet_length(meta::text) AS n FROM {tq}.jobs ORDER BY id")
    assert [r["n"] for r in sizes][:2] == [4096, 4095]


@pytest.mark.parametrize("field", ["payload", "meta"])
def test_an_envelope_postgres_renders_too_large_leaves_the_callers_transaction_usable(
        app: App, queue: Queue, field: str) -> None:
    """1e300 is 6 characters of JSON and 301 digits in jsonb: validation
    measures the size Postgres will store, so the enqueue is refused before
    any statement runs on the caller's connection."""
    tenant = _fresh_tenant()
    value = {"k": [1e300] * 400}  # 3.2 kB of JSON, 121 kB as jsonb
    if field == "payload":
        value = {"k": [1e300] * 1000}  # 8 kB of JSON, 303 kB as jsonb
    with app.connect() as conn:
        conn.execute("INSERT INTO orders (note) VALUES ('kept')")
        with pytest.raises(tenantq.InvalidInput, match="bytes") as caught:
            queue.enqueue(tenant, KIND, conn=conn, **({"payload": value} if field == "payload" else
                                                       {"meta": value}))
        _one_line(caught.value)
        # InvalidInput means nothing was written: the app carries on with its transaction
        assert conn.info.transaction_status == TransactionStatus.INTRANS
        conn.commit()
    assert "kept" in app.orders()


# -- the wrong connection type: one line, nothing written -------------------------------------


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text, repr(text)
    return text


def test_async_connections_given_to_queue_say_use_async_queue(app: App, queue: Queue) -> None:
    async def main() -> list[str]:
        messages = []
        engine = _async_engine(app)
        try:
            async with (await app.aconnect() as aconn, engine.connect() as sa_conn,
                        sa_asyncio.AsyncSession(engine) as sa_session):
                for conn in (aconn, sa_conn, sa_session):
                    with pytest.raises(tenantq.InvalidInput) as caught:
                        queue.enqueue("acme", KIND, conn=conn)
                    messages.append(_one_line(caught.value))
                    with pytest.raises(tenantq.InvalidInput):
                        queue.enqueue_many([JobSpec("acme", KIND)], conn=conn)
        finally:
            await engine.dispose()
        return messages

    for message in asyncio.run(main()):
        assert "use tenantq.AsyncQueue" in message, message
    assert app.tenant_rows("acme") == {"jobs": 0, "wakes": 0}


def test_sync_connections_given_to_async_queue_say_use_queue(app: App, db: Database, engine: Any) -> None:
    async def main(conns: list[object]) -> list[str]:
        messages = []
        async with AsyncQueue(db.dsn, schema=db.schema) as aq:
            for conn in conns:
                with pytest.raises(tenantq.InvalidInput) as caught:
                    await aq.enqueue("acme", KIND, conn=conn)
                messages.append(_one_line(caught.value))
        return messages

    with app.connect() as pg_conn, engine.connect() as sa_conn, orm.Session(engine) as session:
        messages = asyncio.run(main([pg_conn, sa_conn, session]))
    for message in messages:
        assert "use tenantq.Queue" in message, message
    assert app.tenant_rows("acme") == {"jobs": 0, "wakes": 0}


@pytest.mark.parametrize(("make", "expected"), [
    (lambda: sqlite3.connect(":memory:"), "conn must be"),
    (lambda: "postgresql://localhost/db", "conn must be"),
    (lambda: object(), "conn must be"),
])
def test_other_objects_are_refused_in_one_line(queue: Queue, db: Database, make: Callable[[], Any],
                                               expected: str) -> None:
    conn = make()
    try:
        with pytest.raises(tenantq.InvalidInput) as caught:
            queue.enqueue("acme", KIND, conn=conn)
        assert expected in _one_line(caught.value)

        async def main() -> None:
            async with AsyncQueue(db.dsn, schema=db.schema) as aq:
                with pytest.raises(tenantq.InvalidInput) as caught:
                    await aq.enqueue("acme", KIND, conn=conn)
                assert "conn must be" in _one_line(caught.value)

        asyncio.run(main())
    finally:
        if isinstance(conn, sqlite3.Connection):
            conn.close()
    with pytest.raises(tenantq.JobNotFound):
        queue.job(1)


def test_sqlalchemy_on_another_driver_is_refused_in_one_line(queue: Queue) -> None:
    engine = sqlalchemy.create_engine("sqlite://", poolclass=NullPool)
    try:
        with engine.connect() as conn:
            with pytest.raises(tenantq.InvalidInput) as caught:
                queue.enqueue("acme", KIND, conn=conn)
            assert "psycopg" in _one_line(caught.value)
        with orm.Session(engine) as session:
            with pytest.raises(tenantq.InvalidInput) as caught:
                queue.enqueue("acme", KIND, conn=session)
            assert "psycopg" in _one_line(caught.value)
    finally:
        engine.dispose()
