"""kill -9 of the dispatcher while its sandboxes run: the sandboxes end at
once (the guest runner's stdin pipe from the dispatcher reaches EOF), the
reaper removes what is left past the deadline, and a new worker completes
every job."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tenantq import JobSpec, Queue
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.acceptance.helpers import Cli, query
from tests.sandbox.conftest import (
    SLOW_APP,
    Leftovers,
    make_driver,
    processes_mentioning,
    runsc_containers,
    sandbox_dirs,
    worker_args,
)

# expired_dirs() leaves a sandbox alone for this long past its deadline
REAP_GRACE_SECONDS = 5.0
# how long past deadline + grace the sandbox may take to disappear
JOB_SECONDS = 3.0  # under slow.sleep's 5 s timeout: the TTL is 5 + 15 + 30 = 50 s
FLAGS = ("--lease-seconds", "3", "--concurrency", "2", "--batch-size", "1")


def _running_sandboxes(base: Path) -> list[Path]:
    """Sandbox dirs whose guest has started its job."""
    if not base.is_dir():
        return []
    return [p for p in base.iterdir() if (p / "work" / "started").exists()]


def test_kill_9_dispatcher_while_sandboxes_run(driver_name: str, cli: Cli, queue: Queue, db: Database,
                                               data_dir: Path, leftovers: Leftovers) -> None:
    ids = queue.enqueue_many([JobSpec(tenant=f"t{n}", kind="slow.sleep", payload={"seconds": JOB_SECONDS})
                              for n in range(4)])
    base = data_dir / "sandboxes" / driver_name
    worker, worker_err = cli.start(*worker_args(SLOW_APP, driver_name, *FLAGS))

    boxes = wait_until(lambda: len(found := _running_sandboxes(base)) >= 2 and found, timeout=60,
                       message="two sandboxes running a job")
    if driver_name == "gvisor":
        assert len(runsc_containers(data_dir)) >= 2
    deadlines = {p.name: float(json.loads((p / "sandbox.json").read_text())["deadline"]) for p in boxes}
    in_flight = {r["id"] for r in query(db, "SELECT id FROM jobs WHERE status = 'running'")}
    assert len(in_flight) == 2, in_flight

    worker.send_signal(signal.SIGKILL)
    assert worker.wait(timeout=10) == -signal.SIGKILL

    # what runs in the sandboxes stops at once: the guest runner sees its
    # stdin pipe from the dead dispatcher reach EOF, kills the running batch
    # and exits, which ends the sandbox (the TTL is only the backstop)
    marker = str(data_dir)
    stop_within = 10.0
    wait_until(lambda: not processes_mentioning(marker), timeout=stop_within, interval=0.1,
               message="the killed dispatcher's sandbox processes to exit")
    assert runsc_containers(data_dir) == []

    # the leases expire; a new worker completes every job
    wait_until(lambda: not query(db, "SELECT 1 FROM batches WHERE ended_at IS NULL "
                                     "AND lease_expires_at > now()"), timeout=20,
               message="the killed worker's leases to expire")
    res = cli.run(*worker_args(SLOW_APP, driver_name, "--once", *FLAGS), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    for job_id in ids:
        info = queue.job(job_id)
        assert info.status == "done", info
        assert info.result["slept"] == JOB_SECONDS
        # at-least-once: the killed batches' jobs ran again under a new lease
        assert info.attempts == (2 if job_id in in_flight else 1), info

    # the new worker did not reap sandboxes still within their TTL; the
    # reaper (what every worker and `tenantq reap` run) removes them after it
    killed = set(deadlines)
    left = {p.name for p in sandbox_dirs(data_dir)}
    assert killed <= left or time.time() > min(deadlines.values()) + REAP_GRACE_SECONDS, left
    reaper = make_driver(driver_name, data_dir)
    if time.time() < min(deadlines.values()):
        # within their TTL the reaper leaves them alone...
        assert not killed & set(reaper.reap()), "reaped before the TTL"
    # ...and past it removes them: fast-forward (the TTL is 50 s; waiting it
    # out would only wait)
    gone_before = killed - {p.name for p in sandbox_dirs(data_dir)}
    for name in killed - gone_before:
        meta_file = data_dir / "sandboxes" / driver_name / name / "sandbox.json"
        if meta_file.exists():
            meta = json.loads(meta_file.read_text())
            meta["deadline"] = time.time() - REAP_GRACE_SECONDS - 1
            meta_file.write_text(json.dumps(meta))
    removed = set(reaper.reap())
    assert killed - gone_before <= removed, (killed, gone_before, removed)
    assert sandbox_dirs(data_dir) == []
    assert runsc_containers(data_dir) == []
    assert leftovers.cgroups_left(("memory", "pids", "cpu")) == {}
    assert worker_err.exists()


def test_kill_9_dispatcher_with_an_idle_warm_sandbox(driver_name: str, cli: Cli, queue: Queue,
                                                     data_dir: Path, leftovers: Leftovers) -> None:
    """A kept-warm sandbox waits on its stdin pipe to the dispatcher: when the
    dispatcher dies the pipe reaches EOF and the guest runner exits at once
    (no wait for the TTL); the reaper removes the rest once the TTL is past."""
    job_id = queue.enqueue("acme", "slow.sleep", {"seconds": 0})
    base = data_dir / "sandboxes" / driver_name
    worker, _ = cli.start(*worker_args(SLOW_APP, driver_name, "--keep-warm", "600", *FLAGS))
    wait_until(lambda: queue.job(job_id).status == "done", timeout=60, message="the job to finish")
    boxes = wait_until(lambda: list(base.iterdir()) if base.is_dir() else [], timeout=10,
                       message="the kept-warm sandbox")
    marker = str(data_dir)
    assert processes_mentioning(marker), "the warm sandbox is alive while the worker runs"

    worker.send_signal(signal.SIGKILL)
    assert worker.wait(timeout=10) == -signal.SIGKILL
    wait_until(lambda: not processes_mentioning(marker), timeout=10, interval=0.1,
               message="the warm sandbox to exit with its dispatcher")
    assert runsc_containers(data_dir) == []
    # fast-forward past the TTL (keep-warm 600 s): the reaper removes what is left
    for box in boxes:
        meta = json.loads((box / "sandbox.json").read_text())
        meta["deadline"] = time.time() - REAP_GRACE_SECONDS - 1
        (box / "sandbox.json").write_text(json.dumps(meta))
    removed = make_driver(driver_name, data_dir).reap()
    assert {b.name for b in boxes} <= set(removed)
    assert sandbox_dirs(data_dir) == []
