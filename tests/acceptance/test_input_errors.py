"""The bad-input contract beyond enqueue's own checks: every command that
rejects its input exits non-zero with exactly one line on stderr and
writes nothing, including click's usage errors."""

from __future__ import annotations

import pytest

from tenantq import Queue
from tests.acceptance.helpers import Cli, one_error_line

USAGE_ERRORS: dict[str, list[str]] = {
    "non-integer-max-attempts": ["enqueue", "--tenant", "acme", "--kind", "demo.hello",
                                 "--max-attempts", "abc"],
    "missing-tenant": ["enqueue", "--kind", "demo.hello"],
    "unknown-option": ["enqueue", "--tenant", "acme", "--kind", "demo.hello", "--bogus"],
    "non-integer-job-id": ["job", "abc"],
    "zero-concurrency": ["worker", "--app", "tests.apps.basic", "--once", "--concurrency", "0"],
}


@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_usage_error_is_one_line(cli: Cli, queue: Queue, case: str) -> None:
    res = cli.run(*USAGE_ERRORS[case])
    assert res.returncode != 0
    one_error_line(res.stderr)
    assert queue.status() == []


INVALID_TENANT_FILTERS: dict[str, list[str]] = {
    "status": ["status", "--tenant", "bad tenant!"],
    "dead-list": ["dead", "list", "--tenant", "bad tenant!"],
    "dead-retry-all": ["dead", "retry", "--all", "--tenant", "bad tenant!"],
}


@pytest.mark.parametrize("case", list(INVALID_TENANT_FILTERS))
def test_invalid_tenant_filter_is_an_error(cli: Cli, case: str) -> None:
    res = cli.run(*INVALID_TENANT_FILTERS[case])
    assert res.returncode != 0, f"exit 0 for an invalid tenant id; stdout: {res.stdout[:500]}"
    assert "tenant" in one_error_line(res.stderr)
