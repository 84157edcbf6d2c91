"""Cancelling sandboxed jobs, per real driver (gvisor, process): a job that
sleeps in its sandbox is killed by its supervisor on `Queue.cancel` and
ends `cancelled` within CANCEL_BOUND_SECONDS, and the next job of its batch
runs; a guest that says "cancelled" on its own (a handler raising with that
text, or one forging the supervisor's result frame of a cancelled job) is
not believed: only the host's record of a cancel request makes a job
cancelled (docs/security.md, rule H2; dispatch/settle.py)."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.sandboxed import SandboxExecutor
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.registry import REGISTRY
from tenantq.sandbox.channel import Channel
from tenantq.sandbox.driver import SandboxDriver
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.acceptance.helpers import Cli, query, wait_exit
from tests.integration.helpers import running
from tests.sandbox.conftest import worker_args

APP = "tests.apps.controls"
TENANT = "acme"
CANCEL_BOUND_SECONDS = 5.0
BOOT_SECONDS = 90.0
NAP_SECONDS = 60


def _napping(base: Path) -> list[Path]:
    """Sandbox dirs whose nap job has started (its marker in the work dir)."""
    if not base.is_dir():
        return []
    return [p for p in base.iterdir() if (p / "work" / "started").exists()]


def test_a_sleeping_sandboxed_job_is_killed_on_cancel_and_the_next_job_of_its_batch_runs(
        driver_name: str, cli: Cli, queue: Queue, db: Database, data_dir: Path) -> None:
    nap, after = queue.enqueue_many([JobSpec(TENANT, "controls.nap", {"seconds": NAP_SECONDS}),
                                     JobSpec(TENANT, "controls.quick")])
    worker, _ = cli.start(*worker_args(APP, driver_name, "--concurrency", "1", "--batch-size", "2"))
    wait_until(lambda: _napping(data_dir / "sandboxes" / driver_name), timeout=BOOT_SECONDS, interval=0.05,
               message="the nap job asleep in its sandbox")
    rows = query(db, "SELECT id, status, batch_id FROM jobs ORDER BY id")
    assert [r["status"] for r in rows] == ["running", "running"], rows
    assert rows[0]["batch_id"] == rows[1]["batch_id"], "one batch"

    asked = time.monotonic()
    assert queue.cancel(nap, by="ops") is True
    info = queue.wait(nap, timeout=NAP_SECONDS)
    elapsed = time.monotonic() - asked
    print(f"{driver_name}: cancel() to cancelled: {elapsed:.3f} s (bound {CANCEL_BOUND_SECONDS} s)")
    assert info.status == "cancelled", info
    assert elapsed < CANCEL_BOUND_SECONDS, elapsed

    following = queue.wait(after, timeout=60)
    assert following.status == "done" and following.result == {"quick": after}, following
    info = queue.job(nap)
    assert (info.cancelled_by, info.result, info.attempts) == ("ops", None, 1)
    assert [a["outcome"] for a in info.attempts_history] == ["cancelled"]
    assert [a["outcome"] for a in following.attempts_history] == ["done"]
    worker.send_signal(signal.SIGTERM)
    assert wait_exit(worker, timeout=30) == 0


def test_a_guest_saying_cancelled_on_its_own_is_not_believed(driver_name: str, cli: Cli,
                                                            queue: Queue) -> None:
    raised, forged, fine = queue.enqueue_many([
        JobSpec(TENANT, "controls.raise_cancelled", max_attempts=2),
        JobSpec(TENANT, "controls.forge_cancelled", max_attempts=1),
        JobSpec(TENANT, "controls.quick"),
    ])
    res = cli.run(*worker_args(APP, driver_name, "--once", "--concurrency", "1", "--batch-size", "10",
                               "--backoff-base", "3600", "--backoff-cap", "3600"), timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]

    retried = queue.job(raised)
    assert (retried.status, retried.attempts) == ("pending", 1), retried
    assert (retried.last_error or "").startswith("RuntimeError: cancelled"), retried.last_error
    # the forged frame reached the host as reason "cancelled": a failure all the same
    dead = queue.job(forged)
    assert dead.status == "dead", dead
    assert (dead.last_error or "").startswith("cancelled while running"), dead.last_error
    for info in (retried, dead):
        assert info.cancelled_by is None and info.cancel_requested_at is None
        assert [a["outcome"] for a in info.attempts_history] == ["failed"], info.attempts_history
    assert queue.job(fine).status == "done"


def test_a_cancel_sent_as_its_job_is_handed_out_still_stops_it(
        driver: SandboxDriver, queue: Queue, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cancel()` may run (on the worker's listener thread) while the session
    hands the job out: the session holds its cancel lock while it sends the
    `job` frame, so the cancel frame can only follow it (a cancel frame that
    reached the guest first would be dropped as stale). The job must be
    stopped, not left to run to its end."""
    import tests.apps.controls  # noqa: F401  (the host knows the kinds' timeouts)

    seconds = 8
    job = queue.enqueue(TENANT, "controls.nap", {"seconds": seconds})
    cancel_sent = threading.Event()
    handed_out: list[float] = []
    real_send = Channel.send

    def send(self: Channel, value: object, deadline: float) -> None:
        op = value.get("op") if isinstance(value, dict) else None
        if op == "job" and not handed_out and isinstance(value, dict) and value["job"]["id"] == job:
            handed_out.append(time.monotonic())
            assert queue.cancel(job, by="ops") is True  # the notification goes to the listener thread
        real_send(self, value, deadline)
        if op == "cancel":
            cancel_sent.set()

    monkeypatch.setattr(Channel, "send", send)
    executor = SandboxExecutor(driver, REGISTRY, APP)
    worker = Worker(db, executor, WorkerConfig(concurrency=1, batch_size=1, poll_seconds=0.2))
    with running(worker):
        info = queue.wait(job, timeout=seconds + BOOT_SECONDS)
        elapsed = time.monotonic() - handed_out[0]
    print(f"{driver.name}: cancel sent before its job frame: cancelled after {elapsed:.3f} s "
          f"(the job sleeps {seconds} s)")
    assert info.status == "cancelled"
    assert cancel_sent.is_set(), "the worker did not send the cancel frame"
    assert elapsed < CANCEL_BOUND_SECONDS, f"the job ran to its end ({elapsed:.1f} s): the cancel was lost"
