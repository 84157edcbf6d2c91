"""A worker never dies from a batch. A payload nobody can decode fails its
job at once; whatever an executor or the settle bookkeeping raises is
contained in its slot; a settle Postgres refuses is never retried as if it
were transient, it is settled job by job; a connection error is retried.
A worker that cannot carry on stops and says why, and `tenantq worker`
exits non-zero with that one line."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import tests.apps.basic  # noqa: F401  (registers the demo.* handlers)
from tenantq import REGISTRY, Queue
from tenantq.dispatch.executors.contract import JobEnded, JobStarted, Report
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.outcome import Backoff, is_transient
from tenantq.dispatch.settle import BatchRun
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.domain.records import Batch
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.integration.helpers import WorkerThread, fetch_all, fetch_one, running, scalar

NO_BACKOFF = Backoff(base_seconds=0.0, cap_seconds=0.0)


def _config(**overrides: Any) -> WorkerConfig:
    settings: dict[str, Any] = {"concurrency": 1, "batch_size": 10, "lease_seconds": 30, "poll_seconds": 0.1,
                                "backoff": NO_BACKOFF, "failure_backoff_seconds": 0.05}
    settings.update(overrides)
    return WorkerConfig(**settings)


def _job(db: Database, job_id: int) -> dict[str, Any]:
    """Read the row itself (Queue.job decodes the payload, which may be the point)."""
    return fetch_one(db, "SELECT status, attempts, last_error, result, batch_id FROM jobs WHERE id = %(id)s",
                     {"id": job_id})


class ScriptedExecutor:
    """Implements BatchExecutor. A job's payload says what happens to it:
    {"raise": "RecursionError"} raises that from run() once the job started
    ({"raise_before": ...}: before it started), {"result": "surrogate"}
    reports a result Postgres cannot store ({"result": "forged"}: one the
    test's own CHECK refuses), {"error": "surrogate"} a failure
    whose text the driver cannot encode, {"wait": true} waits for `go`;
    anything else succeeds with {"job": id}."""

    name = "scripted"
    RAISES: Mapping[str, Callable[[], BaseException]] = {
        "RecursionError": lambda: RecursionError("maximum recursion depth exceeded"),
        "RuntimeError": lambda: RuntimeError("the runner fell over"),
        "MemoryError": lambda: MemoryError(),
        "SystemExit": lambda: SystemExit(3),
    }

    def __init__(self) -> None:
        self.go = threading.Event()
        self.waiting = threading.Event()
        self.batches: list[tuple[str, int]] = []

    def run(self, batch: Batch, *, env: Mapping[str, str], report: Report,
            should_stop: Callable[[], bool]) -> None:
        self.batches.append((batch.tenant_id, len(batch.jobs)))
        for job in batch.jobs:
            if should_stop():
                return
            script = job.payload if isinstance(job.payload, dict) else {}
            if "raise_before" in script:
                raise self.RAISES[script["raise_before"]]()
            report(JobStarted(job.id))
            if "raise" in script:
                raise self.RAISES[script["raise"]]()
            if script.get("wait"):
                self.waiting.set()
                assert self.go.wait(20), "the test never said go"
            if script.get("result") == "surrogate":
                report(JobEnded(job.id, ok=True, result={"text": "lone \ud800 surrogate"}))
            elif script.get("result") == "forged":
                report(JobEnded(job.id, ok=True, result={"forged": True}))
            elif script.get("error") == "surrogate":
                report(JobEnded(job.id, ok=False, error="failed with a lone \udfff surrogate",
                                retryable=False))
            else:
                report(JobEnded(job.id, ok=True, result={"job": job.id}))


# -- error classification ------------------------------------------------------

@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (psycopg.OperationalError("server closed the connection unexpectedly"), True),
        (psycopg.errors.AdminShutdown("terminating connection due to administrator command"), True),
        (psycopg.errors.CannotConnectNow("the database system is starting up"), True),
        (psycopg.errors.SerializationFailure("could not serialize access"), True),
        (psycopg.errors.TooManyConnections("too many clients"), True),
        (psycopg.InterfaceError("the connection is closed"), True),
        (psycopg.errors.CheckViolation('new row violates check constraint "run_seconds_nonnegative"'), False),
        (psycopg.errors.UntranslatableCharacter("unsupported Unicode escape sequence"), False),
        (psycopg.errors.NumericValueOutOfRange("value out of range: overflow"), False),
        (psycopg.errors.UndefinedTable('relation "scheduler" does not exist'), False),
        (psycopg.errors.StatementTooComplex("stack depth limit exceeded"), False),  # an OperationalError
        (psycopg.errors.PipelineAborted("pipeline aborted"), False),
        (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), False),
        (RuntimeError("anything else"), False),
    ],
)
def test_only_connection_level_errors_are_transient(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


# -- a settle Postgres refuses -------------------------------------------------

def test_a_refused_settle_fails_only_the_offending_job_and_is_not_retried(queue: Queue, db: Database) -> None:
    """A CHECK the batch's settle violates (as a forged negative run time did),
    a result jsonb refuses and an error text the driver cannot encode: each
    fails only its own job, at once, with the reason; the rest of the batch
    keeps its outcomes."""
    with db.connect() as conn:
        conn.execute("ALTER TABLE jobs ADD CONSTRAINT no_forged_result "
                     "CHECK (result IS NULL OR NOT result ? 'forged')")
    payloads: list[Any] = [{}, {"result": "surrogate"}, {}, {"error": "surrogate"}, {},
                           {"result": "forged"}, {}]
    ids = [queue.enqueue("acme", "fake.job", p, max_attempts=1) for p in payloads]
    began = time.monotonic()
    stats = Worker(db, ScriptedExecutor(), _config(once=True, lease_seconds=60)).run()  # type: ignore[arg-type]
    assert time.monotonic() - began < 20, "a refused settle must not be retried until the lease ends"

    assert (stats.done, stats.dead, stats.refused) == (4, 3, 0)
    fine = [ids[i] for i in (0, 2, 4, 6)]
    for job_id in fine:
        assert _job(db, job_id)["status"] == "done"
        assert _job(db, job_id)["result"] == {"job": job_id}
    surrogate = _job(db, ids[1])
    assert surrogate["status"] == "dead"
    assert surrogate["last_error"].startswith("result could not be stored: "), surrogate
    bad_error = _job(db, ids[3])
    assert bad_error["status"] == "dead"
    assert bad_error["last_error"].startswith("error text could not be stored: "), bad_error
    assert "failed with a lone ? surrogate" in bad_error["last_error"]
    forged = _job(db, ids[5])
    assert forged["status"] == "dead"
    assert forged["last_error"] == ('result could not be stored: new row for relation "jobs" violates check '
                                    'constraint "no_forged_result"'), forged
    assert [r["outcome"] for r in fetch_all(db, "SELECT outcome FROM batches")] == ["ok"]


def test_a_connection_error_mid_settle_is_retried(queue: Queue, db: Database) -> None:
    """Postgres drops every connection of the worker while a batch runs: the
    settle is retried on a new connection and nothing is lost."""
    name = f"tq-test-{uuid.uuid4().hex[:8]}"
    own = Database(dsn=make_conninfo(db.dsn, application_name=name), schema=db.schema)
    executor = ScriptedExecutor()
    first = queue.enqueue("acme", "fake.job", {"wait": True})
    second = queue.enqueue("acme", "fake.job", {})
    with running(Worker(own, executor, _config())):  # type: ignore[arg-type]
        assert executor.waiting.wait(15), "the first job to start"
        killed = scalar(db, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                            "WHERE application_name = %(name)s", {"name": name})
        assert killed >= 1
        executor.go.set()
        wait_until(lambda: _job(db, second)["status"] == "done", timeout=20, message="the batch settled")
    assert _job(db, first)["status"] == "done" and _job(db, first)["attempts"] == 1
    assert [r["outcome"] for r in fetch_all(db, "SELECT outcome FROM batches")] == ["ok"]


# -- payloads nobody can decode --------------------------------------------

def test_a_payload_nested_too_deeply_fails_its_job_and_the_worker_carries_on(
    queue: Queue, db: Database
) -> None:
    deep = queue.enqueue("acme", "demo.hello", {}, max_attempts=5)
    sibling = queue.enqueue("acme", "demo.hello", {"n": 1})
    with db.connect() as conn:  # bypassing enqueue, as rows stored before its depth limit
        conn.execute("UPDATE jobs SET payload = (repeat('[', 5000) || repeat(']', 5000))::jsonb "
                     "WHERE id = %(id)s", {"id": deep})
    other = queue.enqueue("globex", "demo.hello", {"n": 2})
    worker = Worker(db, InlineExecutor(REGISTRY), _config(concurrency=2))
    with running(worker) as (thread,):
        wait_until(lambda: _job(db, deep)["status"] == "dead", timeout=15, message="the deep job dead")
        wait_until(lambda: _job(db, other)["status"] == "done", timeout=15, message="globex's job done")
        wait_until(lambda: _job(db, sibling)["status"] == "done", timeout=15, message="its sibling done")
        later = queue.enqueue("acme", "demo.hello", {"n": 3})
        wait_until(lambda: _job(db, later)["status"] == "done", timeout=15, message="the worker still serves")
        assert thread.thread.is_alive() and not worker.failed
    row = _job(db, deep)
    assert (row["attempts"], row["last_error"]) == (1, "payload cannot be decoded: nested too deeply")
    # and it can still be looked at: Queue.job shows a note instead of raising
    info = queue.job(deep)
    assert info.status == "dead" and info.payload == {"undecodable": "nested too deeply to show"}


# -- exceptions in a slot --------------------------------------------------------

@pytest.mark.parametrize("raised", ["RecursionError", "RuntimeError", "MemoryError", "SystemExit"])
def test_an_executor_exception_fails_its_batch_and_the_worker_keeps_serving(
    queue: Queue, db: Database, raised: str
) -> None:
    poison = queue.enqueue("poison", "fake.job", {"raise": raised}, max_attempts=1)
    behind = queue.enqueue("poison", "fake.job", {})
    before = queue.enqueue("poison", "fake.job", {"raise_before": raised}, priority="bulk", max_attempts=3)
    executor = ScriptedExecutor()
    worker = Worker(db, executor, _config(concurrency=2))  # type: ignore[arg-type]
    with running(worker) as (thread,):
        wait_until(lambda: _job(db, poison)["status"] == "dead", timeout=15, message="the poison job dead")
        wait_until(lambda: _job(db, behind)["status"] == "done", timeout=15, message="the job behind it")
        others = [queue.enqueue(f"t{i}", "fake.job", {}) for i in range(4)]
        wait_until(lambda: all(_job(db, j)["status"] == "done" for j in others), timeout=15,
                   message="other tenants' jobs")
        wait_until(lambda: _job(db, before)["status"] == "dead", timeout=15,
                   message="the job the executor fails before it starts, dead after its attempts")
        assert thread.thread.is_alive() and not worker.failed
    dead = _job(db, poison)
    assert dead["last_error"].startswith(f"executor error: the batch's runner failed ({raised}"), dead
    # the executor failed before it started: the first job of the batch is
    # failed with that error, its attempt counted, so it is not a release loop
    first = _job(db, before)
    assert first["attempts"] == 3, first
    assert first["last_error"].startswith(
        f"executor error before the batch's first job started: {raised}"), first
    assert scalar(db, "SELECT count(*) FROM batches WHERE outcome = 'failed'") >= 2
    assert scalar(db, "SELECT count(*) FROM batches WHERE ended_at IS NULL") == 0


def test_an_exception_in_the_settle_bookkeeping_fails_and_releases_the_batch(
    queue: Queue, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    finish = BatchRun.finish
    broke: list[int] = []

    def broken_finish(run: BatchRun, outcome: str) -> None:
        if run.batch.tenant_id == "poison" and not broke:
            broke.append(run.batch.batch_id)
            raise KeyError("a bug in the bookkeeping")
        finish(run, outcome)

    monkeypatch.setattr(BatchRun, "finish", broken_finish)
    started = queue.enqueue("poison", "fake.job", {"raise": "RuntimeError"}, max_attempts=1)
    unstarted = queue.enqueue("poison", "fake.job", {})
    worker = Worker(db, ScriptedExecutor(), _config())  # type: ignore[arg-type]
    with running(worker) as (thread,):
        wait_until(lambda: _job(db, started)["status"] == "dead", timeout=15, message="the started job")
        fine = queue.enqueue("acme", "fake.job", {})
        wait_until(lambda: _job(db, fine)["status"] == "done", timeout=15, message="the next batch")
        # released with its attempt refunded, then run by a later batch: with
        # the worker still running (whether poison's or acme's turn comes
        # first is the round robin's business)
        wait_until(lambda: _job(db, unstarted)["status"] == "done", timeout=15, message="the released job")
        assert thread.thread.is_alive() and not worker.failed
    assert _job(db, started)["last_error"] == ("the worker could not settle this batch: "
                                               "KeyError: 'a bug in the bookkeeping'")
    assert _job(db, unstarted)["attempts"] == 1
    outcomes = [r["outcome"] for r in fetch_all(db, "SELECT outcome FROM batches ORDER BY batch_id")]
    assert outcomes[0] == "failed" and outcomes[1:] == ["ok"] * (len(outcomes) - 1), outcomes


# -- a worker that cannot carry on -------------------------------------------------

def test_a_worker_whose_every_claim_raises_stops_and_says_why(
    queue: Queue, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_claim(self: Worker) -> None:
        raise RuntimeError("claims are broken")

    monkeypatch.setattr(Worker, "_claim", broken_claim)
    queue.enqueue("acme", "fake.job", {})
    worker = Worker(db, ScriptedExecutor(), _config(max_failures=4))  # type: ignore[arg-type]
    thread = WorkerThread(worker).start()
    thread.thread.join(20)
    assert not thread.thread.is_alive(), "the worker should have stopped by itself"
    thread.stop_and_join()
    assert worker.failed
    assert worker.failure == ("4 claims in a row failed with no success in between "
                              "(last: RuntimeError: claims are broken)")


@pytest.fixture
def broken_schema(db: Database, queue: Queue) -> None:
    """Runnable work, but every claim fails in Postgres (its cursor table is gone)."""
    queue.enqueue("acme", "demo.hello")
    with db.connect() as conn:
        conn.execute("ALTER TABLE scheduler RENAME TO scheduler_gone")


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("--concurrency", "4"),
         "10 claims in a row failed with no success in between (last: UndefinedTable: "),
        # a cron drain gives up after 5 tries in a slot, whatever the error
        (("--concurrency", "1", "--once"),
         "the worker could not claim jobs: 5 claims in a row failed (last: UndefinedTable: "),
    ],
)
@pytest.mark.usefixtures("broken_schema")
def test_tenantq_worker_that_cannot_claim_exits_non_zero_with_one_line(
    tenantq_cmd: list[str], cli_env: dict[str, str], args: tuple[str, ...], reason: str
) -> None:
    command = [*tenantq_cmd, "worker", "--app", "tests.apps.basic", "--poll-seconds", "0.1", *args]
    done = subprocess.run(command, env=cli_env, capture_output=True, text=True, timeout=60, check=False,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == errors[0]
    assert errors[0].startswith(f"error: worker stopped: {reason}"), errors[0]
    assert 'relation "scheduler" does not exist' in errors[0]

