"""Workers dying and stopping: kill -9 loses no job, SIGTERM is graceful,
and overlapping `worker --once` runs never run a job twice."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

from tenantq import JobSpec, Queue
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.acceptance.helpers import Cli, query, status_counts, wait_exit, wait_for_text


def _executions(log: Path) -> list[tuple[int, int]]:
    """(job id, pid) per line that demo.record appended."""
    if not log.exists():
        return []
    out: list[tuple[int, int]] = []
    for line in log.read_text().splitlines():
        job_id, pid = line.split()
        out.append((int(job_id), int(pid)))
    return out


def _worker_stats(stderr: Path) -> dict[str, int]:
    """The JSON summary a worker prints as its last stderr line."""
    last = stderr.read_text().strip().splitlines()[-1]
    stats = json.loads(last)
    assert isinstance(stats, dict)
    return stats


def _record_jobs(log: Path, tenants: list[str], per_tenant: int, sleep: float) -> list[JobSpec]:
    return [JobSpec(tenant=t, kind="demo.record", payload={"log": str(log), "sleep": sleep})
            for _ in range(per_tenant) for t in tenants]


def test_kill_9_mid_batch_loses_no_job(cli: Cli, db: Database, queue: Queue, tmp_path: Path) -> None:
    log = tmp_path / "executions.log"
    tenants = ["t1", "t2", "t3", "t4"]
    ids = queue.enqueue_many(_record_jobs(log, tenants, per_tenant=50, sleep=0.02))
    assert len(ids) == 200

    first, _ = cli.start_worker("--concurrency", "2", "--batch-size", "10", "--lease-seconds", "2")

    def mid_batch() -> bool:
        row = query(db, "SELECT count(*) FILTER (WHERE status = 'done') AS done, "
                        "count(*) FILTER (WHERE status = 'running') AS running FROM jobs")[0]
        return bool(row["done"] >= 20 and row["running"] > 0)

    wait_until(mid_batch, timeout=30, message="some jobs done and a batch running")
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=10) == -signal.SIGKILL

    # The dead worker's leases still hold these jobs; nothing will settle them.
    in_flight = {r["id"] for r in query(db, "SELECT id FROM jobs WHERE status = 'running'")}
    assert in_flight, "the kill was meant to land mid-batch"
    live = query(db, "SELECT batch_id, worker_id FROM batches WHERE ended_at IS NULL")
    assert live and all(str(first.pid) in r["worker_id"] for r in live), live
    done_before = {r["id"] for r in query(db, "SELECT id FROM jobs WHERE status = 'done'")}

    second, second_err = cli.start_worker("--concurrency", "2", "--batch-size", "10",
                                          "--lease-seconds", "2")
    wait_until(lambda: status_counts(db).get("done") == 200, timeout=40,
               message="every job done after the restart")
    second.send_signal(signal.SIGTERM)
    assert wait_exit(second) == 0, second_err.read_text()[-3000:]

    rows = query(db, "SELECT id, status, attempts, result FROM jobs ORDER BY id")
    assert len(rows) == 200
    for r in rows:
        assert r["status"] == "done", r
        assert r["result"] == {"job": r["id"]}, r
        # attempts are counted at lease time: the killed lease's jobs ran under two leases
        assert r["attempts"] == (2 if r["id"] in in_flight else 1), r

    runs = Counter(job_id for job_id, _ in _executions(log))
    assert set(runs) == set(ids), "every job ran at least once"
    twice = {job_id for job_id, n in runs.items() if n > 1}
    # at-least-once: only jobs of the killed worker's live batches may run twice
    assert twice <= in_flight, sorted(twice - in_flight)
    assert max(runs.values()) <= 2
    assert not twice & done_before
    pids = {pid for _, pid in _executions(log)}
    assert pids == {first.pid, second.pid}
    stats = _worker_stats(second_err)
    assert stats["reaped"] == len(in_flight), stats
    assert stats["refused"] == 0, stats
    assert status_counts(db) == {"done": 200}
    assert query(db, "SELECT count(*) AS n FROM batches WHERE ended_at IS NULL")[0]["n"] == 0


def test_sigterm_finishes_the_running_job_and_releases_the_rest(
    cli: Cli, db: Database, queue: Queue, tmp_path: Path
) -> None:
    started, release = tmp_path / "started", tmp_path / "release"
    blocked = queue.enqueue("acme", "demo.block", {"started": str(started), "release": str(release),
                                                   "max_seconds": 30})
    rest = queue.enqueue_many([JobSpec(tenant="acme", kind="demo.noop")] * 5)

    worker, err = cli.start_worker("--batch-size", "10", "--concurrency", "2", "--lease-seconds", "5")
    wait_until(started.exists, timeout=20, message="the blocking job to start")

    # one batch holds the blocking job and the five behind it
    rows = query(db, "SELECT id, status, batch_id FROM jobs ORDER BY id")
    assert [r["status"] for r in rows] == ["running"] * 6, rows
    assert len({r["batch_id"] for r in rows}) == 1

    worker.send_signal(signal.SIGTERM)
    wait_for_text(err, "received SIGTERM")  # the stop is registered before the job may end
    release.touch()
    assert wait_exit(worker, timeout=30) == 0, err.read_text()[-3000:]

    info = queue.job(blocked)
    assert (info.status, info.attempts, info.batch_id) == ("done", 1, None)
    for job_id in rest:
        job = queue.job(job_id)
        assert (job.status, job.attempts, job.batch_id, job.started_at) == ("pending", 0, None, None), job
    status = cli.json("status")
    assert status["running_batches"] == []
    assert [t["live_batches"] for t in status["tenants"]] == [0]
    (batch,) = query(db, "SELECT ended_at, outcome FROM batches")
    assert batch["ended_at"] is not None
    stats = _worker_stats(err)
    assert (stats["done"], stats["released"]) == (1, 5), stats

    # the released jobs run normally afterwards, on their first attempt
    assert cli.worker("--once").returncode == 0
    assert all(queue.job(j).status == "done" and queue.job(j).attempts == 1 for j in rest)


def test_two_overlapping_once_workers_share_without_running_a_job_twice(
    cli: Cli, db: Database, queue: Queue, tmp_path: Path
) -> None:
    log = tmp_path / "executions.log"
    ids = queue.enqueue_many(_record_jobs(log, ["t1", "t2", "t3", "t4", "t5"], per_tenant=100,
                                          sleep=0.01))
    assert len(ids) == 500

    args = ("--once", "--concurrency", "2", "--batch-size", "10", "--lease-seconds", "5")
    a, a_err = cli.start_worker(*args)
    b, b_err = cli.start_worker(*args)
    assert wait_exit(a, timeout=60) == 0, a_err.read_text()[-3000:]
    assert wait_exit(b, timeout=60) == 0, b_err.read_text()[-3000:]

    executions = _executions(log)
    assert len(executions) == 500
    assert sorted(job_id for job_id, _ in executions) == sorted(ids)
    by_pid = Counter(pid for _, pid in executions)
    assert set(by_pid) == {a.pid, b.pid}, f"both workers should take part: {by_pid}"
    assert status_counts(db) == {"done": 500}
    assert query(db, "SELECT count(*) AS n FROM jobs WHERE attempts <> 1")[0]["n"] == 0
    stats = [_worker_stats(a_err), _worker_stats(b_err)]
    assert sum(s["done"] for s in stats) == 500, stats
    assert all(s["refused"] == 0 for s in stats), stats
