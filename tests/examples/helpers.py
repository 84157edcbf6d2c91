"""Helpers for the tests of examples/: schemas of the test's own (for
tenantq's tables and for the example app's), and the processes a test
starts (uvicorn, workers), each reaped in teardown."""

from __future__ import annotations

import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import httpx
import psycopg
import pytest
from psycopg import sql as pgsql

from tenantq.store.db import Database
from tenantq.store.migrate import migrate
from tenantq.testing import wait_until

EXIT_TIMEOUT = 15.0


@contextmanager
def schemas(server_dsn: str, prefix: str) -> Iterator[tuple[Database, str]]:
    """A migrated tenantq schema and an empty one for the app's own tables,
    on the same database (as enqueue(conn=...) needs), dropped afterwards."""
    tag = uuid.uuid4().hex[:10]
    tq = Database(dsn=server_dsn, schema=f"tq_{prefix}_{tag}")
    app_schema = f"app_{prefix}_{tag}"
    try:
        migrate(tq)
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("CREATE SCHEMA {}").format(pgsql.Identifier(app_schema)))
        yield tq, app_schema
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            for name in (tq.schema, app_schema):
                conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(name)))


def with_search_path(dsn: str, schema: str) -> str:
    """The URL with `options=-c search_path=SCHEMA`: the app's tables land in
    the test's schema, and the app's connections keep that search_path
    while tenantq's statements name their own schema."""
    parts = urlsplit(dsn)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "options"]
    query.append(("options", f"-c search_path={schema}"))
    return urlunsplit(parts._replace(query=urlencode(query, quote_via=quote)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rows(dsn: str, statement: str, params: Any = None) -> list[dict[str, Any]]:
    from psycopg.rows import dict_row

    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        return list(conn.execute(statement, params).fetchall())


class Processes:
    """Starts processes with their output in files (so nothing blocks on a
    full pipe, and a failure can show it); `cleanup` stops what is left."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        self._files: list[IO[bytes]] = []

    def start(self, name: str, argv: list[str], *, cwd: Path, env: dict[str, str]
              ) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}-{len(self.procs)}.log"
        out = open(log, "wb")  # noqa: SIM115 - closed in cleanup
        self._files.append(out)
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
        self.procs.append((proc, log))
        return proc

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        for known, path in self.procs:
            if known is proc:
                return path.read_text(errors="replace")[-4000:]
        return ""

    def run(self, argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 60.0
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=timeout, check=False)

    def stop(self, proc: subprocess.Popen[bytes]) -> int:
        """SIGTERM (a worker finishes its jobs, uvicorn its shutdown), then the exit status."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=EXIT_TIMEOUT)
            pytest.fail(f"{proc.args!r} did not stop on SIGTERM within {EXIT_TIMEOUT:g} s\n{self.log(proc)}")

    def cleanup(self) -> None:
        try:
            for proc, _ in self.procs:
                if proc.poll() is None:
                    proc.kill()
            for proc, _ in self.procs:
                proc.wait(timeout=EXIT_TIMEOUT)
        finally:
            for out in self._files:
                out.close()


def wait_for_http(url: str, proc: subprocess.Popen[bytes], procs: Processes, *,
                  timeout: float = 30.0) -> None:
    """Poll `url` until it answers, failing at once (with the log) if the server exits."""

    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode} before it answered\n{procs.log(proc)}")
        try:
            httpx.get(url, timeout=2.0)
        except httpx.TransportError:
            return False
        return True

    wait_until(up, timeout=timeout, interval=0.05, message=f"{url} to answer")
