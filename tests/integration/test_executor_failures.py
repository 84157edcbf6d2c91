"""A failing warmup or executor is a failure, not a loop: the batch's first
job takes the error (its attempt counted), the rest go back, the worker
backs off, records the error where `tenantq job` and the dashboard read
it, and `worker --once` exits non-zero with one line."""

from __future__ import annotations

import subprocess
import threading
from typing import Any

import tenantq
from tenantq import Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.registry import Registry
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.integration.helpers import WorkerThread, running

NO_BACKOFF = Backoff(base_seconds=0.0, cap_seconds=0.0)
BROKEN, FLAKY = Registry(), Registry()
WARMUP = "tests.integration.test_executor_failures:broken_warmup"
ERROR = f"WarmupFailed: warmup '{WARMUP}' failed: RuntimeError: the model file is missing"
_flaky_calls: list[int] = []
_flaky_lock = threading.Lock()


def broken_warmup() -> None:
    raise RuntimeError("the model file is missing")


def flaky_warmup() -> None:
    with _flaky_lock:
        _flaky_calls.append(1)
        if len(_flaky_calls) == 1:
            raise RuntimeError("the model server is still starting")


BROKEN.add_warmup(WARMUP, broken_warmup)
FLAKY.add_warmup("tests.integration.test_executor_failures:flaky_warmup", flaky_warmup)


@tenantq.handler("warm.job", isolation="inline", registry=BROKEN)
def warm_job(payload: Any, ctx: tenantq.JobContext) -> None:
    return None


@tenantq.handler("warm.job", isolation="inline", registry=FLAKY)
def flaky_job(payload: Any, ctx: tenantq.JobContext) -> dict[str, int]:
    return {"attempt": ctx.attempt}


def _worker(db: Database, app: Registry, **config: Any) -> Worker:
    settings: dict[str, Any] = {"concurrency": 1, "batch_size": 10, "lease_seconds": 30, "poll_seconds": 0.1,
                                "backoff": NO_BACKOFF, "failure_backoff_seconds": 0.02, "worker_id": "warm-w"}
    settings.update(config)
    return Worker(db, InlineExecutor(app), WorkerConfig(**settings))


def test_once_a_failing_warmup_fails_the_first_job_and_the_drain_exits_failed(queue: Queue,
                                                                              db: Database) -> None:
    first, *rest = [queue.enqueue("acme", "warm.job", {"n": n}) for n in range(3)]
    worker = _worker(db, BROKEN, once=True)
    thread = WorkerThread(worker).start()
    thread.thread.join(20)
    assert not thread.thread.is_alive(), "worker --once must end when its executor keeps failing"
    thread.stop_and_join()
    assert worker.failed
    assert worker.failure == f"the executor failed 3 batches in a row (last: {ERROR})"

    info = queue.job(first)
    assert (info.status, info.attempts) == ("pending", 3), info
    assert info.last_error is not None
    assert info.last_error.startswith(f"executor error before the batch's first job started: {ERROR}\n")
    assert [a["outcome"] for a in info.attempts_history] == ["failed"] * 3
    for job_id in rest:
        other = queue.job(job_id)
        assert (other.status, other.attempts, other.last_error) == ("pending", 0, None)
        assert [a["outcome"] for a in other.attempts_history] == ["released"] * 3
    assert queue.workers() == []


def test_the_executor_error_is_in_the_registry_and_explains_the_wait(queue: Queue, db: Database) -> None:
    ids = [queue.enqueue("acme", "warm.job", {"n": n}, max_attempts=50) for n in range(2)]
    with running(_worker(db, BROKEN, failure_backoff_seconds=0.05)) as (thread,):
        wait_until(lambda: (queue.workers() or [{}])[0].get("executor_failures", 0) >= 2, timeout=15,
                   message="executor failures recorded in the workers table")
        (row,) = queue.workers()
        assert row["last_executor_error"].startswith(ERROR) and row["last_executor_error_at"] is not None
        waiting = queue.job(ids[1]).why_waiting
        assert any(r.startswith("worker warm-w cannot run batches: its executor failed ") and ERROR in r
                   for r in waiting), waiting
        assert thread.thread.is_alive() and not thread.worker.failed


def test_a_warmup_that_recovers_lets_the_job_succeed_and_says_what_failed_first(queue: Queue,
                                                                                db: Database) -> None:
    _flaky_calls.clear()
    job_id = queue.enqueue("acme", "warm.job")
    with running(_worker(db, FLAKY)):
        wait_until(lambda: queue.job(job_id).status == "done", timeout=15, message="the job, second try")
        wait_until(lambda: queue.workers()[0]["executor_failures"] == 0, timeout=10,
                   message="the failure streak reset by a batch that ran")
        (row,) = queue.workers()
        assert "the model server is still starting" in row["last_executor_error"], "kept for the record"
    info = queue.job(job_id)
    assert (info.attempts, info.result, info.last_error) == (2, {"attempt": 2}, None)
    assert info.outcome_note == ("succeeded on attempt 2 after: executor error before the batch's first job "
                                 "started: WarmupFailed: warmup 'tests.integration.test_executor_failures:"
                                 "flaky_warmup' failed: RuntimeError: the model server is still starting")


def test_tenantq_worker_once_with_a_failing_warmup_exits_non_zero_with_one_line(
    queue: Queue, tenantq_cmd: list[str], cli_env: dict[str, str]
) -> None:
    job_id = queue.enqueue("acme", "broken.job")
    # one slot: with the default four, a second slot can have claimed the
    # job again (and failed it a fourth time) while the third failure was
    # stopping the worker, so the attempt count below would race
    command = [*tenantq_cmd, "worker", "--app", "tests.integration.broken_app", "--sandbox", "inline",
               "--once", "--backoff-base", "0", "--poll-seconds", "0.1", "--concurrency", "1"]
    done = subprocess.run(command, env=cli_env, capture_output=True, text=True, timeout=60, check=False,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and done.stderr.splitlines()[-1] == errors[0], done.stderr[-3000:]
    assert errors[0] == ("error: worker stopped: the executor failed 3 batches in a row (last: WarmupFailed: "
                         "warmup 'tests.integration.broken_app:prepare' failed: RuntimeError: the model file "
                         "is missing)"), errors[0]
    info = queue.job(job_id)
    assert (info.status, info.attempts) == ("pending", 3)
    assert "the model file is missing" in (info.last_error or "")
