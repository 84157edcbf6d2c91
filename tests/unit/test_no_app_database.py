"""ctx.db() without a connection: the error says why, for an inline worker
without --app-db and for sandboxed code (which never gets one, whatever the
worker was started with)."""

from __future__ import annotations

import pytest

from tenantq.errors import NoAppDatabase
from tenantq.registry import JobContext


def _ctx(*, sandboxed: bool) -> JobContext:
    return JobContext(tenant="acme", job_id=1, attempt=1, kind="k.x", max_attempts=1, sandboxed=sandboxed)


def test_an_inline_worker_without_an_app_database_says_what_to_set() -> None:
    with pytest.raises(NoAppDatabase, match=r"this worker has no application database .*--app-db URL"):
        _ctx(sandboxed=False).db()


def test_sandboxed_code_is_told_it_never_gets_one_not_to_set_app_db() -> None:
    with pytest.raises(NoAppDatabase) as raised:
        _ctx(sandboxed=True).db()
    message = str(raised.value)
    assert "sandboxed code never gets a database connection" in message
    assert "host function" in message
    assert "this worker has no application database" not in message
