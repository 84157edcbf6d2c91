"""Hostile jobs through the real worker (`tenantq worker --sandbox <driver>
--once` as a subprocess): each fails with its classified reason and ends
dead after its attempts, or (reads, connects, environment) succeeds without
anything leaking; the other tenant's jobs all complete; the worker exits 0;
no secret is left on disk; nothing of the sandboxes is left behind."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tenantq import Queue
from tenantq.sandbox.layout import GUEST_UID
from tenantq.store.db import Database
from tests.acceptance.helpers import Cli
from tests.sandbox.conftest import HOSTILE_APP, files_containing, pg_data_directory, worker_args

BAD, GOOD = "tenant-a", "tenant-b"
WORKER_TIMEOUT = 150.0
# what the sandbox's own environment may hold besides the tenant's secrets
BASE_ENV_KEYS = {"PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PWD", "SHLVL", "_"}


@dataclass(frozen=True)
class Context:
    """What a case's checks need to know about this test run."""

    secrets: dict[str, dict[str, str]]
    secrets_file: Path
    data_dir: Path
    dsn: str
    pg_data: str


@dataclass(frozen=True)
class Case:
    kind: str
    payload: Any = None
    # failing cases: how last_error must read (after both attempts)
    error_prefix: str | None = None
    # any one of these (a fork bomb is stopped by the pids limit or, when its
    # children's pages add up first, by the memory limit: both are containment)
    error_contains: tuple[str, ...] = ()
    # succeeding cases: payload built from the context, and a result check
    build: Callable[[Context], Any] | None = None
    check: Callable[[Any, Context], None] | None = None


def _read_paths(ctx: Context) -> dict[str, Any]:
    return {"paths": ["/etc/shadow", "/etc/passwd", str(ctx.secrets_file), ctx.pg_data,
                      str(Path(ctx.pg_data) / "PG_VERSION"), "/var/lib/tenantq", str(ctx.data_dir),
                      str(ctx.data_dir / "sandboxes"), "/root/.ssh"]}


def _check_read(result: Any, ctx: Context) -> None:
    assert isinstance(result, dict)
    for path, outcome in result.items():
        if path == "/etc/passwd":  # the generated one, not the host's
            assert outcome.startswith("READ:") and "postgres" not in outcome, outcome
        else:
            assert not outcome.startswith(("READ:", "DIR:")), f"{path} is visible in the sandbox: {outcome}"


def _check_connect(result: Any, ctx: Context) -> None:
    assert isinstance(result, dict) and len(result) == 2, result
    for target, outcome in result.items():
        assert outcome != "CONNECTED", f"the sandbox reached {target}"


def _check_env(result: Any, ctx: Context) -> None:
    environ, ctx_env = result["environ"], result["ctx_env"]
    own = ctx.secrets[BAD]
    assert ctx_env == own
    assert {k: environ[k] for k in own} == own
    assert set(environ) - BASE_ENV_KEYS == set(own), environ
    assert not any(k.startswith("TENANTQ") for k in environ), environ


CASES = {
    "alloc_2g_under_256m": Case("box.alloc", {"mb": 2048}, error_prefix="oom: exceeded"),
    "fork_bomb": Case("box.forkbomb", error_contains=("Resource temporarily unavailable",
                                                       "oom: exceeded")),
    "segfault": Case("box.segfault", error_prefix="crashed: SIGSEGV"),
    "infinite_loop": Case("box.spin", error_prefix="timeout after"),
    "signal_blocking_loop": Case("box.spin_c", error_prefix="timeout after"),
    "fill_tmp": Case("box.fill_tmp", error_contains=("No space left",)),
    "read_host_files": Case("box.read", build=_read_paths, check=_check_read),
    "connect_out": Case("box.connect", build=lambda ctx: {"targets": [["127.0.0.1", 5432],
                                                                      ["10.255.255.1", 80]]},
                        check=_check_connect),
    "print_environment": Case("box.env", check=_check_env),
}


@pytest.mark.parametrize("case_id", list(CASES))
def test_hostile_job(case_id: str, driver_name: str, cli: Cli, queue: Queue, db: Database, data_dir: Path,
                     secrets: dict[str, dict[str, str]], secrets_file: Path) -> None:
    case = CASES[case_id]
    ctx = Context(secrets=secrets, secrets_file=secrets_file, data_dir=data_dir, dsn=db.dsn,
                  pg_data=pg_data_directory(db))
    payload = case.build(ctx) if case.build else case.payload
    bad = queue.enqueue(BAD, case.kind, payload, max_attempts=2)
    good = [queue.enqueue(GOOD, "box.echo", {"n": n}) for n in range(3)]
    good_env = queue.enqueue(GOOD, "box.env", None) if case.kind == "box.env" else None

    res = cli.run(*worker_args(HOSTILE_APP, driver_name, "--once", "--concurrency", "2", "--backoff-base",
                               "0", "--secrets", str(secrets_file)), timeout=WORKER_TIMEOUT)
    assert res.returncode == 0, f"worker exited {res.returncode}:\n{res.stderr[-3000:]}"

    info = queue.job(bad)
    if case.check is None:
        assert info.status == "dead", info
        assert info.attempts == 2, info
        error = info.last_error or ""
        if case.error_prefix:
            assert error.startswith(case.error_prefix), error[:600]
        if case.error_contains:
            assert any(text in error for text in case.error_contains), error[:600]
    else:
        assert info.status == "done", info
        assert info.attempts == 1, info
        case.check(info.result, ctx)

    # the other tenant was not held up or touched
    for job_id in good:
        echo = queue.job(job_id)
        assert echo.status == "done", echo
        assert echo.result["tenant"] == GOOD and echo.result["uid"] == GUEST_UID, echo.result
    if good_env is not None:
        other = queue.job(good_env)
        assert other.status == "done", other
        assert other.result["ctx_env"] == secrets[GOOD]
        dumped = json.dumps(other.result)
        assert all(v not in dumped for v in secrets[BAD].values()), "tenant B saw tenant A's secret"
        assert db.dsn not in dumped

    # nothing of any secret (nor the DSN) in a result, a log line, or a file left on disk
    values = [v for per_tenant in secrets.values() for v in per_tenant.values()]
    results = json.dumps([queue.job(j).result for j in [bad, *good]])
    own = set(secrets[BAD].values()) if case.kind == "box.env" else set()
    assert all(v not in results for v in values if v not in own), results[:2000]
    assert db.dsn not in results
    assert all(v not in res.stderr for v in values), "a secret reached the worker's log"
    assert files_containing(data_dir, [*values, secrets_file.read_text()]) == []


def test_a_result_postgres_cannot_store_still_settles(driver_name: str, cli: Cli, queue: Queue) -> None:
    """/proc/self/cmdline is NUL-separated: a result holding "\\u0000" cannot
    go into a jsonb column. The job must still settle (done, or failed with a
    clear error) and must not take its batch's finished siblings down with it."""
    first = queue.enqueue(BAD, "box.echo", {"n": 0}, max_attempts=2)
    nul = queue.enqueue(BAD, "box.read", {"paths": ["/proc/self/cmdline"]}, max_attempts=2)
    last = queue.enqueue(BAD, "box.echo", {"n": 1}, max_attempts=2)
    res = cli.run(*worker_args(HOSTILE_APP, driver_name, "--once", "--backoff-base", "0", "--lease-seconds",
                               "3"), timeout=WORKER_TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    for job_id in (first, last):
        echo = queue.job(job_id)
        assert echo.status == "done", echo
    info = queue.job(nul)
    assert info.status in ("done", "dead"), f"{info.status}, attempts {info.attempts}; worker log:\n" + \
        res.stderr[-1500:]
    if info.status == "dead":
        assert info.last_error, info
