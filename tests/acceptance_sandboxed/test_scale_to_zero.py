"""`tenantq worker --once` as the cron drainer: exits 0 when idle, leaves no
lease or sandbox behind, and overlapping runs never run a job twice."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tenantq import JobSpec, Queue
from tenantq.sandbox.drivers import bwrap_works
from tenantq.store.db import Database
from tests.acceptance.helpers import Cli, query

needs_bwrap = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap (bwrap) is not installed or does not "
                                 "work here; the process sandbox driver needs it")


def _sandbox_dirs(data_dir: Path) -> list[Path]:
    base = data_dir / "sandboxes" / "process"
    return [p for p in base.iterdir()] if base.is_dir() else []


@needs_bwrap
def test_once_on_an_empty_queue_exits_zero_at_once(cli: Cli, db: Database, tmp_path: Path) -> None:
    cli.env["TENANTQ_DATA_DIR"] = str(tmp_path / "data")
    started = time.monotonic()
    res = cli.run("worker", "--app", "tests.apps.hostile", "--sandbox", "process", "--once")
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - started < 20
    assert query(db, "SELECT count(*) AS n FROM batches")[0]["n"] == 0
    assert _sandbox_dirs(tmp_path / "data") == []


@needs_bwrap
def test_overlapping_sandboxed_drains_share_the_work(cli: Cli, db: Database, queue: Queue,
                                                       tmp_path: Path) -> None:
    cli.env["TENANTQ_DATA_DIR"] = str(tmp_path / "data")
    queue.enqueue_many([JobSpec(f"t{i % 4}", "box.echo", {"i": i}) for i in range(120)])
    args = [*cli.cmd, "worker", "--app", "tests.apps.hostile", "--sandbox", "process", "--once",
            "--concurrency", "2", "--batch-size", "10"]
    procs = [subprocess.Popen(args, env=cli.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(2)]
    cli.procs.extend(procs)  # killed in teardown if a wait below fails
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    rows = query(db, "SELECT status, attempts, count(*) AS n FROM jobs GROUP BY status, attempts")
    assert rows == [{"status": "done", "attempts": 1, "n": 120}]  # each job ran exactly once
    assert query(db, "SELECT count(*) AS n FROM batches WHERE ended_at IS NULL")[0]["n"] == 0
    assert _sandbox_dirs(tmp_path / "data") == []
