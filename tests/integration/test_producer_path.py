"""Issue 35 (producer-path), item 5: an open producer transaction stalls no
one. Tested through the public API only: `Queue` / `AsyncQueue`,
`enqueue(..., conn=...)`, `enqueue_many(..., conn=...)`, real workers (the
`tenantq worker --sandbox inline` CLI, or `Worker` with the inline executor in
a thread of this process) and the Django example project under
`ATOMIC_REQUESTS`.

- The stalled fleet: a producer's transaction that enqueued one `acme` job
  stays open while a worker drains the committed jobs of `acme` and `beta`.
- Two connections: while connection A's transaction that enqueued for a
  tenant is open, connection B's enqueue for the same tenant (and one
  without `conn=`) returns in under 200 ms, for `enqueue`, `enqueue_many`
  on both of its paths (statement and COPY), a delayed job, a keyed job and
  `AsyncQueue.enqueue`; with the tenant busy, idle or brand new.
- A worker's claim and settle (a retry) while a producer's transaction of
  the same tenant and class is open.
- Django `ATOMIC_REQUESTS`: two concurrent requests of one tenant, the
  first held inside its transaction after enqueuing.
- No lost wake-up: 8 producers with random commit/rollback, delays and keys
  beside 2 workers; every committed job runs exactly once, nothing rolled
  back exists, nothing is stranded.

Nothing here waits with a bare sleep: conditions are polled with a
deadline, or threads meet on events. Every connection, transaction, thread
and process a test opens is closed in its teardown, rolled back first when
it is still open (so a worker blocked behind it can stop).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import types
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
import pytest
from psycopg.pq import TransactionStatus

import tenantq
from tenantq import AsyncQueue, JobSpec, Queue, Registry
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.store.db import Database
from tenantq.testing import drain, wait_until
from tests.conftest import ROOT
from tests.integration.helpers import fetch_all, running, scalar, status_counts

# -- the handlers the in-process workers run -------------------------------------------------

REG = Registry()
KIND = "producer_path.count"
GATE_KIND = "producer_path.gate"

# executions of KIND, by (the test's run token, job id): "exactly once" is counted here
EXECUTIONS: Counter[tuple[str, int]] = Counter()
_EXECUTIONS_LOCK = threading.Lock()


@tenantq.handler(KIND, isolation="inline", registry=REG)
def count(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, int]:
    with _EXECUTIONS_LOCK:
        EXECUTIONS[(str(payload["run"]), ctx.job_id)] += 1
    return {"job": ctx.job_id}


@dataclass
class Gate:
    """Attempt 1 of a GATE_KIND job says it started, waits to be released, then fails."""

    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


GATES: dict[str, Gate] = {}
GATE_HOLD_SECONDS = 30.0


@tenantq.handler(GATE_KIND, isolation="inline", registry=REG)
def gate(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, int]:
    if ctx.attempt == 1:
        held = GATES[str(payload["gate"])]
        held.started.set()
        if not held.release.wait(GATE_HOLD_SECONDS):
            raise RuntimeError("the test never released the gate")
        raise RuntimeError("fails on attempt 1, as the test wants")
    return {"attempt": ctx.attempt}


NO_BACKOFF = Backoff(base_seconds=0.0, cap_seconds=0.0)


def _worker(db: Database, *, concurrency: int = 2, batch_size: int = 10, poll_seconds: float = 0.2) -> Worker:
    config = WorkerConfig(concurrency=concurrency, batch_size=batch_size, lease_seconds=30,
                          poll_seconds=poll_seconds, backoff=NO_BACKOFF)
    return Worker(db, InlineExecutor(REG), config)


# -- the producer's side ---------------------------------------------------------------------

# the promise of issue 35: a second enqueue returns this fast while another producer's
# transaction of the same tenant is open
# on B's connection: a wait for a lock longer than this is an error (LockNotAvailable), however
# loaded the machine: waiting for A's transaction is a lock wait, and nothing else counts towards it
LOCK_TIMEOUT_MS = 200
# the wall-clock backstop (B and C): a call that waits for A takes until A ends (5 s, cancelled); a
# 1,000-job COPY takes 20-35 ms on an idle 2-core machine and up to ~1 s beside the sandbox suites
SECOND_ENQUEUE_SECONDS = 2.0
# on B's connection: an enqueue that waits for A is cancelled (the test fails) instead of hanging
STATEMENT_TIMEOUT_MS = 5000


@contextmanager
def open_transaction(dsn: str, *, name: str, statement_timeout_ms: int | None = None,
                     lock_timeout_ms: int | None = None) -> Iterator[psycopg.Connection[Any]]:
    """The app's own connection (autocommit off): its first statement opens
    the transaction. Rolled back (if still open) and closed on the way out."""
    settings = [f"-c {k}={v}" for k, v in (("statement_timeout", statement_timeout_ms),
                                           ("lock_timeout", lock_timeout_ms)) if v is not None]
    options = " ".join(settings) or None
    conn = psycopg.connect(dsn, application_name=name, options=options)  # (None: not set)
    try:
        yield conn
    finally:
        try:
            if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
                conn.rollback()
        finally:
            conn.close()


def _still_open(conn: psycopg.Connection[Any]) -> bool:
    return conn.info.transaction_status == TransactionStatus.INTRANS


def _exists(queue: Queue, job_id: int) -> bool:
    try:
        queue.job(job_id)
    except tenantq.JobNotFound:
        return False
    return True


def _lock_waits(db: Database) -> list[str]:
    """tenantq's and this module's sessions waiting on a lock (for failure messages)."""
    rows = fetch_all(db, "SELECT application_name AS app, wait_event, "
                         "left(regexp_replace(query, '\\s+', ' ', 'g'), 90) AS query FROM pg_stat_activity "
                         "WHERE datname = current_database() AND wait_event_type = 'Lock' "
                         "AND (application_name LIKE 'tenantq%%' OR application_name LIKE 'pp-%%')")
    return [f"{r['app']} waits ({r['wait_event']}) in: {r['query']}" for r in rows]


def _wait_for(predicate: Callable[[], bool], *, timeout: float, what: str,
              state: Callable[[], object]) -> None:
    """Poll `predicate` (20 ms apart) up to `timeout`; fail with `state()` and the lock waits."""
    try:
        wait_until(predicate, timeout=timeout, message=what)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout:g} s waiting for {what}; state: {state()}", pytrace=False)


# -- 1. the stalled fleet --------------------------------------------------------------------


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.mark.parametrize("outcome", ["rollback", "commit"])
def test_an_open_producer_transaction_does_not_stall_the_worker(
    queue: Queue, db: Database, server_dsn: str, cli_env: dict[str, str], tenantq_cmd: list[str],
    tmp_path: Path, outcome: str,
) -> None:
    """5 committed jobs each for acme and beta; a producer's transaction
    enqueues one more acme job and stays open; `tenantq worker --sandbox
    inline`, started then, runs all 10 committed jobs while it is open. The
    transaction's job is invisible throughout; rolled back it never exists,
    committed it runs."""
    committed = [queue.enqueue(tenant, "demo.hello", {"n": n})
                 for tenant in ("acme", "beta") for n in range(5)]
    log = tmp_path / "worker.stderr"
    proc: subprocess.Popen[bytes] | None = None

    def done() -> int:
        return int(scalar(db, "SELECT count(*) FROM jobs WHERE status = 'done' AND id = ANY(%(ids)s)",
                          {"ids": committed}))

    def state() -> object:
        worker_exit = None if proc is None else proc.poll()
        return {"done": done(), "of": len(committed), "by status": status_counts(db),
                "worker exit": worker_exit, "lock waits": _lock_waits(db),
                "worker log": log.read_text(errors="replace")[-1500:] if log.exists() else ""}

    with open_transaction(server_dsn, name="pp-producer") as tx, open(log, "wb") as err:
        try:
            held = queue.enqueue("acme", "demo.hello", {"n": "in the open transaction"}, conn=tx)
            proc = subprocess.Popen([*tenantq_cmd, "worker", "--app", "tests.apps.basic",
                                     "--sandbox", "inline", "--concurrency", "4", "--poll-seconds", "0.2"],
                                    env=cli_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err)
            _wait_for(lambda: proc is not None and proc.poll() is None and done() == len(committed),
                      timeout=20, what="the worker to run acme's and beta's 10 committed jobs "
                                       "while a producer's transaction for acme is open", state=state)
            assert _still_open(tx), "the producer's transaction ended under the test"
            assert not _exists(queue, held), "a job of an open transaction is visible"
            if outcome == "commit":
                tx.commit()
                _wait_for(lambda: queue.job(held).status == "done", timeout=10,
                          what="the committed job to run", state=state)
            else:
                tx.rollback()
                assert not _exists(queue, held), "a rolled-back job exists"
        finally:
            tx.rollback()  # a no-op when it ended above; else the worker can carry on and stop
            if proc is not None:
                _stop_process(proc)
    assert proc is not None and proc.returncode == 0, log.read_text(errors="replace")[-3000:]
    rows = fetch_all(db, "SELECT id, status, attempts FROM jobs ORDER BY id")
    expected = sorted(committed + ([held] if outcome == "commit" else []))
    assert [r["id"] for r in rows] == expected, ("the rolled-back job exists" if outcome == "rollback"
                                                 else rows)
    assert all((r["status"], r["attempts"]) == ("done", 1) for r in rows), rows


# -- 2. two connections ----------------------------------------------------------------------

FORMS = ["enqueue", "enqueue_many", "enqueue_many_copy", "delayed", "keyed", "async_enqueue"]
# the tenant's state when A's transaction begins: pending jobs, no pending job
# (all done), or no row at all (A's open transaction is its very first enqueue)
PRIORS = ["busy", "idle", "new"]
ENQUEUE_MANY_SMALL = 5
# docs/using-from-your-app.md: "From 1,000 jobs without idempotency keys it writes them with COPY"
COPY_PATH_JOBS = 1_000
DELAY_SECONDS = 1.0


@dataclass
class Timed:
    """One producer call: its job ids, how long it took, what it raised."""

    who: str
    ids: list[int] = field(default_factory=list)
    elapsed: float | None = None
    error: BaseException | None = None

    def problem(self, form: str, limit: float) -> str | None:
        if self.error is not None:
            return f"{self.who}'s {form} raised after {self.elapsed or 0:.3f} s: {self.error!r}"
        if self.elapsed is None:
            return f"{self.who}'s {form} had not returned when A's transaction ended"
        if self.elapsed >= limit:
            return f"{self.who}'s {form} took {self.elapsed:.3f} s (limit {limit:.3f} s)"
        return None


def _payload(run: str, who: str) -> dict[str, Any]:
    return {"run": run, "who": who}


def _call(queue: Queue, form: str, tenant: str, run: str, who: str, conn: Any) -> list[int]:
    """One producer call of `form` (the sync API; async_enqueue's A uses plain enqueue)."""
    payload = _payload(run, who)
    if form in ("enqueue", "async_enqueue"):
        return [queue.enqueue(tenant, KIND, payload, conn=conn)]
    if form == "delayed":
        return [queue.enqueue(tenant, KIND, payload, delay=DELAY_SECONDS, conn=conn)]
    if form == "keyed":
        return [queue.enqueue(tenant, KIND, payload, key=f"{who}-{run}", conn=conn)]
    size = COPY_PATH_JOBS if form == "enqueue_many_copy" else ENQUEUE_MANY_SMALL
    ids: list[int] = queue.enqueue_many([JobSpec(tenant, KIND, {**payload, "i": i}) for i in range(size)],
                                        conn=conn)
    return ids


def _timed(result: Timed, call: Callable[[], list[int]]) -> Timed:
    started = time.perf_counter()
    try:
        result.ids = call()
    except Exception as exc:
        result.error = exc
    result.elapsed = time.perf_counter() - started
    return result


def _b_sync(queue: Queue, server_dsn: str, form: str, tenant: str, run: str) -> Timed:
    """B: its own transaction (statement_timeout set), enqueue with conn=B, commit."""
    result = Timed("B (conn=B)")
    with open_transaction(server_dsn, name="pp-b", statement_timeout_ms=STATEMENT_TIMEOUT_MS,
                          lock_timeout_ms=LOCK_TIMEOUT_MS) as b:
        _timed(result, lambda: _call(queue, form, tenant, run, "b", b))
        if result.error is None:
            b.commit()
    return result


async def _b_async(db: Database, server_dsn: str, tenant: str, run: str) -> Timed:
    """B on asyncio: AsyncQueue.enqueue with conn= an AsyncConnection, then commit."""
    result = Timed("B (AsyncQueue, conn=B)")
    b = await psycopg.AsyncConnection.connect(server_dsn, application_name="pp-b",
                                              options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS} "
                                                      f"-c lock_timeout={LOCK_TIMEOUT_MS}")
    try:
        async with AsyncQueue(db.dsn, schema=db.schema) as aqueue:
            started = time.perf_counter()
            try:
                result.ids = [await aqueue.enqueue(tenant, KIND, _payload(run, "b"), conn=b)]
            except Exception as exc:
                result.error = exc
            result.elapsed = time.perf_counter() - started
        if result.error is None:
            await b.commit()
    finally:
        await b.rollback()
        await b.close()
    return result


class ThirdProducer(threading.Thread):
    """C: the same call without conn= (the queue's own pool, autocommit), in a
    thread, so the test can give up on it and still end A's transaction."""

    def __init__(self, db: Database, queue: Queue, form: str, tenant: str, run: str) -> None:
        super().__init__(name="pp-c", daemon=True)
        self.db, self.queue, self.form, self.tenant, self.run_token = db, queue, form, tenant, run
        self.result = Timed("C (no conn)")
        self.warm = threading.Event()

    def run(self) -> None:
        if self.form == "async_enqueue":
            asyncio.run(self._async())
        else:
            self.warm.set()  # the fixture's queue has its pool already
            _timed(self.result, lambda: _call(self.queue, self.form, self.tenant, self.run_token, "c", None))

    async def _async(self) -> None:
        self.result.who = "C (AsyncQueue, no conn)"
        try:
            async with AsyncQueue(self.db.dsn, schema=self.db.schema) as aqueue:
                await aqueue.status(self.tenant)  # its pool's first connection, outside the timing
                self.warm.set()
                started = time.perf_counter()
                try:
                    self.result.ids = [await aqueue.enqueue(self.tenant, KIND, _payload(self.run_token, "c"))]
                except Exception as exc:
                    self.result.error = exc
                self.result.elapsed = time.perf_counter() - started
        finally:
            self.warm.set()


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The connections a COPY ran on (psycopg's Cursor.copy, spied): proof that
    enqueue_many took its COPY path, whatever tenantq's threshold is named."""
    seen: list[Any] = []
    original = psycopg.Cursor.copy

    def spy(self: psycopg.Cursor[Any], *args: Any, **kwargs: Any) -> Any:
        seen.append(self.connection)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "copy", spy)
    return seen


TWO_CONNECTION_CASES = [
    *[pytest.param(form, prior, "rollback", id=f"{form}-{prior}") for form in FORMS for prior in PRIORS],
    *[pytest.param("enqueue", prior, "commit", id=f"enqueue-{prior}-a_commits") for prior in PRIORS],
]


@pytest.mark.parametrize(("form", "prior", "a_outcome"), TWO_CONNECTION_CASES)
def test_a_second_producer_does_not_wait_for_an_open_transaction(
    queue: Queue, db: Database, server_dsn: str, copies: list[Any], form: str, prior: str, a_outcome: str,
) -> None:
    """A enqueues for `acme` with conn=A and keeps its transaction open. B's
    same call with conn=B never waits for a lock more than 200 ms
    (lock_timeout: a wait for A's transaction raises, whatever the machine's
    load), and B and a third one without conn= return well before A ends
    (2 s, or 3x the same call made alone just before when the machine is so
    loaded that this is more; a call that waits for A takes until A ends:
    5 s, cancelled). Then A rolls back (or commits), and a worker runs B's
    and C's jobs (and A's if committed): nothing A did or undid strands them."""
    tenant, run = "acme", uuid.uuid4().hex
    with open_transaction(server_dsn, name="pp-baseline") as alone:
        baseline = _timed(Timed("alone"), lambda: _call(queue, form, "baseline", run, "alone", alone))
    assert baseline.error is None and baseline.elapsed is not None, baseline
    limit = max(SECOND_ENQUEUE_SECONDS, 3 * baseline.elapsed)
    copies.clear()
    before: list[int] = []
    if prior in ("busy", "idle"):
        before = [queue.enqueue(tenant, KIND, _payload(run, "before"))]
        if prior == "idle":
            assert drain(db, REG).done == 1
    else:
        queue.status()  # the fixture queue's pool, so that C's call is timed without a connect
    third: ThirdProducer | None = None
    a_ids: list[int] = []
    with open_transaction(server_dsn, name="pp-a") as a:
        try:
            a_ids = _call(queue, form, tenant, run, "a", a)
            third = ThirdProducer(db, queue, form, tenant, run)
            third.start()
            third.warm.wait(10)
            if form == "async_enqueue":
                b = asyncio.run(_b_async(db, server_dsn, tenant, run))
            else:
                b = _b_sync(queue, server_dsn, form, tenant, run)
            third.join(2.0)  # C started with B: far longer than it may take
            assert _still_open(a), "A's transaction ended under the test"
            if a_outcome == "commit":
                a.commit()
        finally:
            a.rollback()  # a no-op after the commit; else anything blocked behind A can finish
            if third is not None:
                third.join(30)
    assert third is not None and not third.is_alive()
    c = third.result
    problems = [p for p in (b.problem(form, limit), c.problem(form, limit)) if p is not None]
    assert not problems, (f"while A's transaction for {prior} tenant {tenant} was open "
                          f"(the call alone took {baseline.elapsed:.3f} s):\n" + "\n".join(problems))
    if form == "enqueue_many_copy":
        assert a in copies and any(conn is not a for conn in copies), \
            "enqueue_many did not take its COPY path"
    sizes = {"enqueue_many": ENQUEUE_MANY_SMALL, "enqueue_many_copy": COPY_PATH_JOBS}
    assert len(b.ids) == len(c.ids) == len(a_ids) == sizes.get(form, 1)

    # what is left: B's and C's jobs (and A's when it committed), and all of them run
    expected = before + b.ids + c.ids + (a_ids if a_outcome == "commit" else [])
    gone = [] if a_outcome == "commit" else a_ids
    assert int(scalar(db, "SELECT count(*) FROM jobs WHERE id = ANY(%(ids)s)", {"ids": gone})) == 0, \
        "a job of A's rolled-back transaction exists"
    assert int(scalar(db, "SELECT count(*) FROM jobs")) == len(expected)

    def finished() -> int:
        return int(scalar(db, "SELECT count(*) FROM jobs WHERE status = 'done' AND attempts = 1 "
                              "AND id = ANY(%(ids)s)", {"ids": expected}))

    with running(_worker(db, concurrency=4, batch_size=100)):
        _wait_for(lambda: finished() == len(expected), timeout=30, what="a worker to run every committed job",
                  state=lambda: {"done": finished(), "of": len(expected), "by status": status_counts(db)})
    assert int(scalar(db, "SELECT count(*) FROM jobs")) == len(expected)


# -- 3. a worker's claim and settle while a producer's transaction is open ------------------


@pytest.mark.parametrize("outcome", ["rollback", "commit"])
def test_a_worker_settles_a_retry_and_claims_again_while_a_producer_transaction_is_open(
    queue: Queue, db: Database, server_dsn: str, outcome: str,
) -> None:
    """A job of acme is running (attempt 1) when a producer's transaction
    enqueues for acme in the same class and stays open. Attempt 1 then fails:
    its settle (a retry, no backoff) and the claim of attempt 2 both go
    through while the transaction is open, and attempt 2 finishes."""
    run, token = uuid.uuid4().hex, uuid.uuid4().hex
    GATES[token] = held = Gate()
    gated = queue.enqueue("acme", GATE_KIND, {"gate": token, "run": run}, max_attempts=3)

    def state() -> object:
        info = queue.job(gated)
        return {"status": info.status, "attempts": info.attempts, "last_error": (info.last_error or "")[:80],
                "lock waits": _lock_waits(db)}

    def settled() -> bool:  # attempt 1 ended: its retry was written
        info = queue.job(gated)
        return bool(info.attempts >= 2 or info.status == "done"
                    or (info.attempts == 1 and info.status == "pending"))

    try:
        with running(_worker(db, concurrency=2)):
            assert held.started.wait(15), "the worker did not start the gated job"
            with open_transaction(server_dsn, name="pp-producer") as tx:
                try:
                    produced = queue.enqueue("acme", KIND, _payload(run, "tx"), conn=tx)
                    held.release.set()  # attempt 1 now fails
                    _wait_for(settled, timeout=10, state=state,
                              what="the settle of attempt 1 (a retry) while a producer's transaction is open")
                    _wait_for(lambda: queue.job(gated).status == "done", timeout=10, state=state,
                              what="attempt 2 to be claimed and done while a producer's transaction is open")
                    assert _still_open(tx), "the producer's transaction ended under the test"
                    if outcome == "commit":
                        tx.commit()
                finally:
                    held.release.set()
                    tx.rollback()
            if outcome == "commit":
                _wait_for(lambda: queue.job(produced).status == "done", timeout=10,
                          what="the committed job to run", state=state)
    finally:
        held.release.set()
        GATES.pop(token, None)
    info = queue.job(gated)
    assert (info.status, info.attempts, info.result) == ("done", 2, {"attempt": 2})
    outcomes = [(h["attempt"], h["outcome"]) for h in info.attempts_history]
    assert outcomes == [(1, "failed"), (2, "done")], info.attempts_history
    assert "fails on attempt 1" in str(info.attempts_history[0]["error"])
    assert _exists(queue, produced) is (outcome == "commit")


# -- 4. Django ATOMIC_REQUESTS: two concurrent requests of one tenant ------------------------
#
# Django's settings are process-wide and tests/examples/test_django_app.py
# needs a process in which nobody configured them, so the requests run in a
# child Python (warnings as errors), as in test_transactional_enqueue.py. It
# runs examples/django_app, the project of docs/using-from-your-app.md, with
# ATOMIC_REQUESTS = True and its POST /orders view (which enqueues with
# conn=django.db.connection); the URL conf wraps that view so that a request
# marked X-Hold stops, after the view returned, inside the request's
# transaction, until the test releases it.

DJANGO_PROJECT = ROOT / "examples" / "django_app"
SECOND_REQUEST_SECONDS = 2.0
_DJANGO_CHILD = ("import sys; from tests.integration.test_producer_path import _django_child; "
                 "_django_child(sys.argv[1])")


def _django_url(server_dsn: str, app_schema: str) -> str:
    """The project's DATABASE_URL: its tables in the app's schema; a statement
    that waits more than 5 s is cancelled (the request then fails, not hangs)."""
    parts = urlsplit(server_dsn)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "options"]
    query.append(("options", f"-c search_path={app_schema} -c statement_timeout={STATEMENT_TIMEOUT_MS}"))
    return urlunsplit(parts._replace(query=urlencode(query, quote_via=quote)))


def _django_child(spec_json: str) -> None:
    """In the child: two requests of one tenant through Django's test client,
    each in a thread of its own (and so on a connection of its own)."""
    spec = json.loads(spec_json)
    import django
    from django.conf import settings

    settings.DATABASES["default"]["ATOMIC_REQUESTS"] = True  # loads mysite.settings
    urls = types.ModuleType("producer_path_urls")
    sys.modules[urls.__name__] = urls
    settings.ROOT_URLCONF = urls.__name__
    django.setup()
    from django.core.management import call_command
    from django.db import connection, connections
    from django.http import HttpRequest, HttpResponse
    from django.test import Client
    from django.test.utils import setup_test_environment, teardown_test_environment
    from django.urls import path
    from shop import views
    from shop.queue import queue

    entered, release = threading.Event(), threading.Event()
    held: dict[str, Any] = {}

    def create_order_held(request: HttpRequest) -> HttpResponse:
        response = views.create_order(request)
        if request.headers.get("X-Hold") == "1":
            held["in_atomic_block"] = connection.in_atomic_block  # ATOMIC_REQUESTS' transaction
            entered.set()
            held["released"] = release.wait(60)
        return response

    urls.urlpatterns = [path("orders", create_order_held)]  # type: ignore[attr-defined]

    def post(tenant: str, item: str, *, hold: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        started = time.perf_counter()
        try:
            body = json.dumps({"tenant": tenant, "item": item, "amount_cents": 100})
            response = Client().post("/orders", body, content_type="application/json",
                                     headers={"X-Hold": "1" if hold else "0", "X-User": "ada@example.com"})
            out["status"] = response.status_code
            out["body"] = response.json()
        except Exception as exc:
            out["error"] = repr(exc)
        finally:
            out["elapsed"] = time.perf_counter() - started
            connections.close_all()  # this thread's connection
        return out

    results: dict[str, Any] = {"tenant": spec["tenant"]}

    def request(name: str, item: str, hold: bool) -> None:
        results[name] = post(spec["tenant"], item, hold=hold)

    first = threading.Thread(target=request, args=("first", "held", True), daemon=True)
    second = threading.Thread(target=request, args=("second", "quick", False), daemon=True)
    setup_test_environment()
    try:
        call_command("migrate", verbosity=0)
        if spec["tenant_state"] == "existing":
            results["earlier"] = post(spec["tenant"], "earlier", hold=False)
        first.start()
        results["entered"] = entered.wait(30)
        if results["entered"]:
            second.start()
            second.join(SECOND_REQUEST_SECONDS + STATEMENT_TIMEOUT_MS / 1000 + 5)
            results["second_alive_at_release"] = second.is_alive()
    finally:
        release.set()
        for thread in (first, second):
            if thread.is_alive() or thread.ident is not None:
                thread.join(60)
        results["held"] = held
        teardown_test_environment()
        queue.close()
        connections.close_all()
    print(json.dumps(results))


@pytest.mark.slow
@pytest.mark.parametrize("tenant_state", ["existing", "new"])
def test_django_atomic_requests_of_one_tenant_do_not_wait_for_each_other(
    server_dsn: str, tenant_state: str,
) -> None:
    """Request 1 (ATOMIC_REQUESTS) enqueues for a tenant and is held inside
    its transaction; request 2 of the same tenant completes meanwhile, within
    2 s. Then request 1 commits: both orders and both jobs exist."""
    pytest.importorskip("django")
    from tests.examples.helpers import schemas

    tenant = f"shop-{uuid.uuid4().hex[:8]}"
    with schemas(server_dsn, "pp") as (tq, app_schema):
        env = dict(os.environ)
        env.update({"DATABASE_URL": _django_url(server_dsn, app_schema), "TENANTQ_SCHEMA": tq.schema,
                    "DJANGO_SETTINGS_MODULE": "mysite.settings",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(DJANGO_PROJECT),
                                                                env.get("PYTHONPATH")]))})
        spec = {"tenant": tenant, "tenant_state": tenant_state}
        res = subprocess.run([sys.executable, "-W", "error", "-c", _DJANGO_CHILD, json.dumps(spec)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=150, check=False,
                             stdin=subprocess.DEVNULL)
        assert res.returncode == 0, f"the Django child failed:\n{res.stderr[-4000:]}"
        out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
        if tenant_state == "existing":
            assert out["earlier"].get("status") == 201, out["earlier"]
        assert out["entered"], f"request 1 never reached its hold: {out.get('first')}"
        assert out["held"] == {"in_atomic_block": True, "released": True}, out["held"]
        second, first = out["second"], out["first"]
        assert "error" not in second, (
            f"request 2 failed after {second['elapsed']:.2f} s while request 1 held its transaction: "
            f"{second['error']}")
        assert second["status"] == 201, second
        assert second["elapsed"] < SECOND_REQUEST_SECONDS, (
            f"request 2 took {second['elapsed']:.2f} s while request 1 held its transaction")
        assert first.get("status") == 201, first

        job_ids = [r["body"]["job_id"] for r in (first, second)]
        with Queue(server_dsn, schema=tq.schema) as q:
            for job_id in job_ids:
                info = q.job(job_id)
                assert (info.tenant_id, info.kind, info.status) == (tenant, "receipts.send", "pending"), info
        orders = fetch_all(Database(dsn=server_dsn, schema=app_schema),
                           "SELECT receipt_job FROM shop_order WHERE tenant = %(t)s ORDER BY id",
                           {"t": tenant})
        assert [o["receipt_job"] for o in orders][-2:] == job_ids


# -- 5. no lost wake-up ----------------------------------------------------------------------

PRODUCERS = 8
ROUNDS = 10
SHARED_TENANTS = ("acme", "beta", "gamma")


@dataclass
class ProducerLog:
    committed: list[int] = field(default_factory=list)
    rolled_back: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class Producer(threading.Thread):
    """One app process's requests: ROUNDS transactions, each 1-3 enqueues
    (random tenant, class, delay, key; some enqueue_many), some work of its
    own in the transaction, then commit or (30%) rollback. A key committed
    earlier is sometimes enqueued again: it must return the existing id."""

    def __init__(self, index: int, queue: Queue, server_dsn: str, run: str) -> None:
        super().__init__(name=f"pp-producer-{index}", daemon=True)
        self.index, self.queue, self.server_dsn, self.run_token = index, queue, server_dsn, run
        self.log = ProducerLog()

    def run(self) -> None:
        try:
            self._produce()
        except Exception as exc:
            self.log.problems.append(f"producer {self.index}: {exc!r}")

    def _produce(self) -> None:
        rng = random.Random(f"{self.run_token}-{self.index}")
        keys: list[tuple[str, str, int]] = []  # committed (tenant, key, id)
        with open_transaction(self.server_dsn, name=f"pp-producer-{self.index}") as conn:
            for round_ in range(ROUNDS):
                ids: list[int] = []
                keyed: list[tuple[str, str, int]] = []
                for j in range(rng.randint(1, 3)):
                    tenant = rng.choice((*SHARED_TENANTS, f"solo-{self.index}"))
                    priority = rng.choice(("default", "default", "interactive"))
                    delay = rng.choice((0.0, 0.0, 0.0, 0.2, 0.4))
                    key = f"k-{self.index}-{round_}-{j}" if rng.random() < 0.3 else None
                    payload = {"run": self.run_token, "p": self.index, "r": round_, "j": j}
                    if rng.random() < 0.25:
                        specs = [JobSpec(tenant, KIND, {**payload, "m": m}, priority=priority, delay=delay,
                                         key=None if key is None else f"{key}-{m}")
                                 for m in range(rng.randint(2, 4))]
                        new = self.queue.enqueue_many(specs, conn=conn)
                        keyed += [(s.tenant, s.key, i) for s, i in zip(specs, new, strict=True) if s.key]
                    else:
                        new = [self.queue.enqueue(tenant, KIND, payload, priority=priority, delay=delay,
                                                  key=key, conn=conn)]
                        if key is not None:
                            keyed.append((tenant, key, new[0]))
                    ids += new
                if keys and rng.random() < 0.3:  # a retried request: the same key again
                    tenant, key, existing = rng.choice(keys)
                    again = self.queue.enqueue(tenant, KIND, {"run": self.run_token, "again": True},
                                               key=key, conn=conn)
                    if again != existing:
                        self.log.problems.append(f"key {key} of {tenant}: enqueued again as {again}, "
                                                 f"not {existing}")
                # the request's own work, inside its transaction
                conn.execute("SELECT count(*) FROM generate_series(1, %s)", [rng.randint(1_000, 100_000)])
                if rng.random() < 0.3:
                    conn.rollback()
                    self.log.rolled_back += ids
                else:
                    conn.commit()
                    self.log.committed += ids
                    keys += keyed


@pytest.mark.slow
def test_no_lost_wake_up_with_many_producers_and_workers(queue: Queue, db: Database, server_dsn: str) -> None:
    """8 producers (random tenant, class, delay 0-0.4 s, keys, commit or
    rollback) beside 2 workers: at the end every committed job is done, run
    exactly once (attempts 1, one execution), no rolled-back job exists and
    nothing is left pending."""
    run = uuid.uuid4().hex
    producers = [Producer(i, queue, server_dsn, run) for i in range(PRODUCERS)]
    started = time.monotonic()
    with running(_worker(db, concurrency=2, batch_size=5, poll_seconds=0.5),
                 _worker(db, concurrency=2, batch_size=5, poll_seconds=0.5)):
        try:
            for producer in producers:
                producer.start()
            for producer in producers:
                producer.join(max(0.1, started + 20 - time.monotonic()))
            late = [p.name for p in producers if p.is_alive()]
            assert not late, f"producers still running after 20 s: {late}; lock waits: {_lock_waits(db)}"
        finally:
            for producer in producers:
                producer.join(60)
        problems = [p for producer in producers for p in producer.log.problems]
        assert not problems, "\n".join(problems)
        committed = sorted(i for p in producers for i in p.log.committed)
        rolled_back = sorted(i for p in producers for i in p.log.rolled_back)
        assert committed and rolled_back, "the random mix should both commit and roll back"

        def finished() -> int:
            return int(scalar(db, "SELECT count(*) FROM jobs WHERE status = 'done'"))

        _wait_for(lambda: finished() >= len(committed), timeout=15, what="every committed job to be done",
                  state=lambda: {"done": finished(), "committed": len(committed),
                                 "by status": status_counts(db)})
    rows = {int(r["id"]): r for r in fetch_all(db, "SELECT id, status, attempts FROM jobs")}
    missing, extra = sorted(set(committed) - set(rows)), sorted(set(rows) - set(committed))
    assert not missing and not extra, f"committed jobs missing: {missing}; jobs nobody committed: {extra}"
    assert not set(rolled_back) & set(rows), "a rolled-back job exists"
    stranded = {i: (r["status"], r["attempts"]) for i, r in rows.items()
                if (r["status"], r["attempts"]) != ("done", 1)}
    assert not stranded, f"not done exactly once: {stranded}"
    with _EXECUTIONS_LOCK:
        runs = {i: EXECUTIONS[(run, i)] for i in committed + rolled_back}
    assert all(runs[i] == 1 for i in committed), {i: n for i, n in runs.items() if n != 1 and i in rows}
    assert not any(runs[i] for i in rolled_back), "a rolled-back job ran"
    assert time.monotonic() - started < 30
