"""Rule I1: hostile input at enqueue changes nothing. Through the Python API
(Queue.enqueue, Queue.enqueue_many) and the CLI (`tenantq enqueue` as a
subprocess): a NUL character, a lone surrogate, a tenant id or kind ending in
a newline, a payload nested 5,000 levels deep. Each is one line of
InvalidInput (CLI: exactly one stderr line, a non-zero exit, nothing on
stdout) and no row is written. (No sandbox is involved, so these run once,
not per driver; rule H6's "in the table anyway" case is in test_channel.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tenantq import JobSpec, Queue
from tenantq.errors import InvalidInput
from tenantq.store.db import Database
from tests.acceptance.helpers import Cli, one_error_line, query
from tests.adversarial.attack_app import nested

DEPTH = 5000
GOOD: dict[str, Any] = {"tenant": "mallory", "kind": "adv.echo", "payload": {"n": 1}}
API_CASES: dict[str, dict[str, Any]] = {
    "nul": {"payload": {"note": "a\x00b"}},
    "nul-in-key": {"payload": {"\x00": 1}},
    "lone-surrogate": {"payload": {"note": "\ud800"}},
    "lone-surrogate-key": {"payload": {"\udfff": 1}},
    "tenant-newline": {"tenant": "mallory\n"},
    "kind-newline": {"kind": "adv.echo\n"},
    "nested-5000": {"payload": nested(DEPTH)},
}
CLI_CASES: dict[str, list[str]] = {
    "nul": ["--payload", '{"note": "a\\u0000b"}'],
    "lone-surrogate": ["--payload", '{"note": "\\ud800"}'],
    "tenant-newline": ["--tenant", "mallory\n"],
    "kind-newline": ["--kind", "adv.echo\n"],
    "nested-5000": ["--payload", "[" * DEPTH + "]" * DEPTH],
}


def rows(db: Database) -> dict[str, int]:
    row = query(db, "SELECT (SELECT count(*) FROM jobs) AS jobs, (SELECT count(*) FROM tenants) AS tenants, "
                    "(SELECT count(*) FROM queues) AS queues")[0]
    return {k: int(v) for k, v in row.items()}


@pytest.fixture
def seeded(queue: Queue, db: Database) -> dict[str, int]:
    """One good job first, so that "nothing written" is a count that must not move."""
    queue.enqueue(GOOD["tenant"], GOOD["kind"], GOOD["payload"])
    return rows(db)


@pytest.fixture
def cli(tenantq_cmd: list[str], cli_env: dict[str, str], tmp_path: Path) -> Iterator[Cli]:
    runner = Cli(tenantq_cmd, cli_env, tmp_path)
    try:
        yield runner
    finally:
        runner.cleanup()


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_refuses_in_one_line(queue: Queue, db: Database, seeded: dict[str, int], case: str) -> None:
    job = {**GOOD, **API_CASES[case]}
    with pytest.raises(InvalidInput) as refused:
        queue.enqueue(job["tenant"], job["kind"], job["payload"])
    message = str(refused.value)
    assert message and "\n" not in message, repr(message)
    with pytest.raises(InvalidInput) as refused_many:
        queue.enqueue_many([JobSpec(tenant="acme", kind="adv.echo"), JobSpec(**job)])
    assert "\n" not in str(refused_many.value), repr(str(refused_many.value))
    assert rows(db) == seeded


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_refuses_in_one_line(cli: Cli, db: Database, seeded: dict[str, int], case: str) -> None:
    options = {"--tenant": GOOD["tenant"], "--kind": GOOD["kind"], "--payload": '{"n": 1}'}
    extra = CLI_CASES[case]
    options.update(dict(zip(extra[::2], extra[1::2], strict=True)))
    res = cli.run("enqueue", *(part for item in options.items() for part in item))
    assert res.returncode != 0, f"exit 0 for hostile input {case}; stdout {res.stdout[:200]!r}"
    assert res.stdout == "", res.stdout[:200]
    one_error_line(res.stderr)
    assert rows(db) == seeded
