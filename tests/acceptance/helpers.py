"""Helpers for the acceptance suite: the `tenantq` CLI run as real
subprocesses against the test's own schema. Every process started through
`Cli` is tracked, and `Cli.cleanup` kills and reaps whatever is still alive."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import IO, Any

import pytest

from tenantq.store.db import Database
from tenantq.testing import wait_until

CLI_TIMEOUT = 60.0
APP = "tests.apps.basic"


class Cli:
    """Runs `tenantq ...` in subprocesses; remembers every long-running one."""

    def __init__(self, cmd: list[str], env: dict[str, str], tmp: Path) -> None:
        self.cmd = cmd
        self.env = env
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self._files: list[IO[bytes]] = []
        self._seq = 0

    # -- one-shot commands ---------------------------------------------
    def run(self, *args: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """Run to completion (killed by subprocess.run if it overruns)."""
        return subprocess.run([*self.cmd, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False, stdin=subprocess.DEVNULL)

    def ok(self, *args: str, timeout: float = CLI_TIMEOUT) -> str:
        """Run, require exit 0, return stdout."""
        res = self.run(*args, timeout=timeout)
        assert res.returncode == 0, (
            f"tenantq {' '.join(args)[:200]} exited {res.returncode}\n"
            f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-2000:]}"
        )
        return res.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.ok(*args, "--json"))

    def worker(self, *args: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """`tenantq worker --app tests.apps.basic ARGS` to completion."""
        return self.run("worker", "--app", APP, *args, timeout=timeout)

    # -- long-running processes -----------------------------------------
    def start(self, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        """Start `tenantq ARGS` in the background; its stderr goes to a file
        (returned) so the test can wait on log lines without a pipe filling up."""
        self._seq += 1
        err_path = self.tmp / f"proc-{self._seq}.stderr"
        err = open(err_path, "wb")  # noqa: SIM115 - closed in teardown
        self._files.append(err)
        proc = subprocess.Popen([*self.cmd, *args], env=self.env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err)
        self.procs.append(proc)
        return proc, err_path

    def start_worker(self, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        return self.start("worker", "--app", APP, *args)

    def cleanup(self) -> None:
        try:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
            for proc in self.procs:
                proc.wait(timeout=30)
        finally:
            for fh in self._files:
                fh.close()


def query(db: Database, statement: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Read the test's schema directly (the CLI's view is checked separately)."""
    with db.connect() as conn:
        return list(conn.execute(statement, params or {}).fetchall())


def status_counts(db: Database) -> dict[str, int]:
    rows = query(db, "SELECT status, count(*) AS n FROM jobs GROUP BY status")
    return {str(r["status"]): int(r["n"]) for r in rows}


def wait_exit(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """Wait for a process we expect to exit by itself."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"process {proc.args!r} did not exit within {timeout}s")


def wait_for_text(path: Path, text: str, *, timeout: float = 15.0) -> None:
    wait_until(lambda: path.exists() and text in path.read_text(errors="replace"),
               timeout=timeout, message=f"{text!r} in {path.name}")


def one_error_line(stderr: str) -> str:
    """The contract for bad input: exactly one line on stderr, an error."""
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected exactly one stderr line, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith(("error:", "Error:")), lines[0]
    return lines[0]
