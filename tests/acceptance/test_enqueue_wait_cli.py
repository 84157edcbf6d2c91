"""`tenantq enqueue --wait` as a user runs it, against a real worker process:
prints the ended job as JSON and exits 0 when it is done, 1 when it is dead
or cancelled, 124 (one line on stderr) when --timeout passes first; and
`--actor` / `--meta` travel with the job (`tenantq job ID`, `--json`, the
handler's ctx)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tenantq import Queue
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.acceptance.helpers import Cli, one_error_line, query, wait_exit

WAIT = ("--wait", "--timeout", "60")


@contextmanager
def worker(cli: Cli, queue: Queue, tmp_path: Path, app: str = "tests.apps.basic") -> Iterator[None]:
    """A real inline worker process, registered before the block runs and
    stopped (SIGTERM, then reaped) after it."""
    cli.env["TENANTQ_DATA_DIR"] = str(tmp_path / "data")
    proc, err = cli.start("worker", "--app", app, "--sandbox", "inline", "--concurrency", "1",
                          "--poll-seconds", "0.2", "--backoff-base", "0", "--backoff-cap", "0")
    try:
        wait_until(lambda: proc.poll() is not None or bool(queue.workers()), timeout=30,
                   message="the worker to register")
        assert proc.poll() is None, err.read_text()[-2000:]
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = wait_exit(proc, timeout=30)
        assert code == 0, f"worker exited {code}: {err.read_text()[-2000:]}"


def _ended(stdout: str) -> dict[str, Any]:
    lines = stdout.strip().splitlines()
    assert lines, "nothing on stdout"
    ended: dict[str, Any] = json.loads(stdout)
    assert set(ended) >= {"id", "status", "result", "outcome", "last_error"}, ended
    return ended


def test_enqueue_wait_prints_the_result_and_exits_0(cli: Cli, queue: Queue, tmp_path: Path) -> None:
    with worker(cli, queue, tmp_path):
        started = time.monotonic()
        res = cli.run("enqueue", "--tenant", "acme", "--kind", "demo.hello", "--payload", '{"x": 1}', *WAIT)
        took = time.monotonic() - started
    assert res.returncode == 0, res.stderr
    ended = _ended(res.stdout)
    assert ended["status"] == "done" and ended["last_error"] is None, ended
    assert ended["result"] == {"hello": "acme", "job": ended["id"], "attempt": 1, "payload": {"x": 1}}
    assert queue.job(ended["id"]).status == "done"
    print(f"\nenqueue --wait round trip (process start to exit): {took:.2f}s")


def test_a_job_that_fails_every_attempt_exits_1(cli: Cli, queue: Queue, tmp_path: Path) -> None:
    with worker(cli, queue, tmp_path):
        res = cli.run("enqueue", "--tenant", "acme", "--kind", "demo.fail", "--max-attempts", "2", *WAIT)
    assert res.returncode == 1, (res.stdout, res.stderr)
    ended = _ended(res.stdout)
    assert ended["status"] == "dead" and ended["result"] is None, ended
    assert "boom on attempt 2" in ended["last_error"], ended
    info = queue.job(ended["id"])
    assert info.status == "dead" and info.attempts == 2


def test_a_cancelled_job_exits_1(cli: Cli, queue: Queue, db: Database, tmp_path: Path) -> None:
    out = tmp_path / "wait.out"
    with out.open("wb") as fh:
        proc = subprocess.Popen([*cli.cmd, "enqueue", "--tenant", "acme", "--kind", "demo.hello",
                                 "--delay", "3600", *WAIT], env=cli.env, stdin=subprocess.DEVNULL,
                                stdout=fh, stderr=subprocess.PIPE)
    cli.procs.append(proc)  # killed in teardown if anything below fails
    rows = wait_until(lambda: query(db, "SELECT id FROM jobs"), timeout=30, message="the job to exist")
    job_id = int(rows[0]["id"])
    wait_until(lambda: query(db, "SELECT count(*) AS n FROM pg_stat_activity "
                                 "WHERE application_name = 'tenantq-waits' AND query = %(q)s",
                             {"q": f'LISTEN "{db.done_channel}"'})[0]["n"] > 0,
               timeout=30, message="the CLI to listen for the job's end")
    assert queue.cancel(job_id) is True
    code = wait_exit(proc, timeout=30)
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert code == 1, stderr
    ended = _ended(out.read_text())
    assert (ended["id"], ended["status"], ended["result"]) == (job_id, "cancelled", None)
    assert stderr == ""


def test_timeout_without_a_worker_exits_124_with_one_line(cli: Cli, queue: Queue, db: Database) -> None:
    started = time.monotonic()
    res = cli.run("enqueue", "--tenant", "acme", "--kind", "demo.hello", "--wait", "--timeout", "0.5")
    took = time.monotonic() - started
    assert res.returncode == 124, (res.stdout, res.stderr)
    assert res.stdout == ""
    line = one_error_line(res.stderr)
    assert "did not end within 0.5 s" in line and "pending" in line, line
    assert took < 20
    (row,) = query(db, "SELECT status FROM jobs")
    assert row["status"] == "pending", "the job stays queued; only the wait gave up"


@pytest.mark.parametrize(("args", "message"), [
    (["--timeout", "5"], "--timeout goes with --wait"),
    (["--wait", "--timeout", "-1"], "timeout must be"),
    (["--wait", "--timeout", "nan"], "timeout must be"),
    (["--meta", "no-equals-sign"], "--meta takes KEY=VALUE"),
    (["--meta", "[1, 2]"], "--meta takes KEY=VALUE"),
    (["--meta", "{not json"], "--meta is not a JSON object"),
    (["--actor", "bad\nactor"], "control character"),
    (["--actor", "x" * 201], "actor"),
])
def test_bad_envelope_and_wait_options_are_one_line(cli: Cli, db: Database, args: list[str],
                                                    message: str) -> None:
    res = cli.run("enqueue", "--tenant", "acme", "--kind", "demo.hello", *args)
    assert res.returncode != 0 and res.stdout == "", (res.returncode, res.stdout)
    assert message in one_error_line(res.stderr)
    assert query(db, "SELECT count(*) AS n FROM jobs") == [{"n": 0}]


def test_actor_and_meta_show_in_job_output(cli: Cli, queue: Queue) -> None:
    job_id = int(cli.ok("enqueue", "--tenant", "acme", "--kind", "demo.hello", "--actor", "usr_1",
                        "--meta", "request_id=r-1", "--meta", "plan=pro").strip())
    shown = cli.ok("job", str(job_id))
    assert "usr_1" in shown and "r-1" in shown and "plan" in shown, shown
    as_json = cli.json("job", str(job_id))
    assert as_json["actor"] == "usr_1"
    assert as_json["meta"] == {"request_id": "r-1", "plan": "pro"}
    # a JSON object is accepted too, values keep their types
    other = int(cli.ok("enqueue", "--tenant", "acme", "--kind", "demo.hello",
                       "--meta", '{"request_id": "r-2", "attempt": 3, "tags": ["a"]}').strip())
    again = cli.json("job", str(other))
    assert again["actor"] is None and again["meta"] == {"request_id": "r-2", "attempt": 3, "tags": ["a"]}
    info = queue.job(job_id)
    assert (info.actor, info.meta) == ("usr_1", {"request_id": "r-1", "plan": "pro"})


def test_actor_and_meta_reach_the_handler_through_enqueue_wait(cli: Cli, queue: Queue,
                                                               tmp_path: Path) -> None:
    with worker(cli, queue, tmp_path, app="tests.apps.envelope"):
        res = cli.run("enqueue", "--tenant", "acme", "--kind", "env.whoami_inline", "--actor", "usr_9",
                      "--meta", "request_id=r-9", *WAIT)
    assert res.returncode == 0, res.stderr
    ended = _ended(res.stdout)
    assert ended["status"] == "done"
    assert (ended["result"]["actor"], ended["result"]["meta"]) == ("usr_9", {"request_id": "r-9"})


def test_several_wait_clients_at_once_all_exit_0(cli: Cli, queue: Queue, tmp_path: Path) -> None:
    """Many --wait clients at once against one worker: all exit 0."""
    with worker(cli, queue, tmp_path):
        procs = [subprocess.Popen([*cli.cmd, "enqueue", "--tenant", f"t{i}", "--kind", "demo.hello",
                                   "--payload", json.dumps({"i": i}), *WAIT], env=cli.env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for i in range(4)]
        cli.procs.extend(procs)
        outputs = [p.communicate(timeout=90) for p in procs]
    for i, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, stderr.decode()
        ended = _ended(stdout.decode())
        assert ended["status"] == "done" and ended["result"]["payload"] == {"i": i}

