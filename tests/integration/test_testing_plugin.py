"""`tenantq.testing` as users meet it: installed, its fixtures are there in
every pytest run (the `pytest11` entry point), also under `-W error` and
also with the README's old `pytest_plugins = ["tenantq.testing"]` line;
and `drain()` gives inline handlers the configured application database
(TENANTQ_APP_DATABASE_URL), as `tenantq worker` does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tenantq.store.db import Database

USERS_TEST = '''
import tenantq
from tenantq.testing import drain, wait_until

{plugins}

@tenantq.handler("plugin.check", isolation="inline")
def check(payload: dict, ctx: tenantq.JobContext) -> dict:
    with ctx.db() as conn:
        row = conn.execute("SELECT current_setting('app.current_tenant_id') AS t").fetchone()
    return {{"tenant_seen": row[0] if isinstance(row, tuple) else row["t"]}}


def test_the_fixtures_and_drain(tenantq_db, tenantq_queue):
    job_id = tenantq_queue.enqueue("acme", "plugin.check", {{}})
    drain(tenantq_db)
    info = tenantq_queue.job(job_id)
    assert info.status == "done", info.last_error
    assert wait_until(lambda: tenantq_queue.job(job_id).result) == {{"tenant_seen": "acme"}}
'''


def _run_users_pytest(tmp_path: Path, db: Database, plugins: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_users.py").write_text(USERS_TEST.format(plugins=plugins))
    env = {**os.environ, "TENANTQ_DATABASE_URL": db.dsn, "TENANTQ_APP_DATABASE_URL": db.dsn}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("TENANTQ_SCHEMA", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-W", "error", "-p", "no:cacheprovider",
                           "test_users.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize("plugins", ["", 'pytest_plugins = ["tenantq.testing"]'],
                         ids=["entry-point", "old-line"])
def test_users_tests_get_the_fixtures_under_w_error(tmp_path: Path, db: Database, plugins: str) -> None:
    done = _run_users_pytest(tmp_path, db, plugins)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout, done.stdout
    assert "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
