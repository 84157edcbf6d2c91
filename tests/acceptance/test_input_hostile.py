"""Hostile enqueue input through both doors, the Python API (tenantq.Queue)
and the CLI as a subprocess, against the real database: a NUL character or a
lone surrogate anywhere in a payload, a payload nested past the depth limit
(990 and 100,000 levels), a tenant id or kind with a trailing newline, a bad
idempotency key. Each is one InvalidInput line (CLI: a non-zero exit and
exactly one line on stderr) and nothing is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tenantq import JobSpec, Queue
from tenantq.domain.validation import MAX_PAYLOAD_DEPTH
from tenantq.errors import InvalidInput
from tenantq.store.db import Database
from tests.acceptance.helpers import Cli, one_error_line, query

NUL = "payload contains a NUL character (\\u0000), which Postgres cannot store"


def surrogate(shown: str) -> str:
    return f"payload contains a lone surrogate ({shown}), which is not valid Unicode"


def too_deep(depth: int) -> str:
    return f"payload is nested {depth} levels deep; the limit is {MAX_PAYLOAD_DEPTH}"


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def written(db: Database) -> dict[str, int]:
    """Rows in every table an enqueue writes."""
    row = query(db, "SELECT (SELECT count(*) FROM jobs) AS jobs, (SELECT count(*) FROM tenants) AS tenants, "
                    "(SELECT count(*) FROM queues) AS queues")[0]
    return {k: int(v) for k, v in row.items()}


# -- the Python API ----------------------------------------------------------

# case -> (enqueue keyword arguments over a good job, the exact message)
API_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "nul-in-value": ({"payload": {"text": "a\x00b"}}, NUL),
    "nul-in-key": ({"payload": {"a\x00": 1}}, NUL),
    "nul-deep-inside": ({"payload": [1, {"x": [{"y": ["ok", "\x00"]}]}]}, NUL),
    "nul-scalar": ({"payload": "\x00"}, NUL),
    "lone-high-surrogate": ({"payload": {"s": "\ud800"}}, surrogate("\\ud800")),
    "lone-surrogate-key": ({"payload": {"\udfff": [1]}}, surrogate("\\udfff")),
    "nested-990": ({"payload": nested(990)}, too_deep(990)),
    "nested-100000": ({"payload": nested(100_000)}, too_deep(100_000)),
    "nested-one-past-the-limit": ({"payload": nested(65)}, too_deep(65)),
    "tenant-trailing-newline": (
        {"tenant": "acme\n"},
        "tenant id 'acme\\n' is invalid: use letters, digits and . _ : @ - "
        "(starting with a letter or digit)"),
    "kind-trailing-newline": (
        {"kind": "demo.hello\n"},
        "kind 'demo.hello\\n' is invalid: 1-200 characters of letters, digits and _ . : - "
        "(starting with a letter or _)"),
    "key-with-nul": (
        {"key": "order\x0042"},
        "idempotency key contains a NUL character (\\u0000), which Postgres cannot store"),
    "key-with-lone-surrogate": (
        {"key": "order\udcff"},
        "idempotency key contains a lone surrogate (\\udcff), which is not valid Unicode"),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_rejects_hostile_input_and_writes_nothing(queue: Queue, db: Database, case: str) -> None:
    queue.enqueue("acme", "demo.hello", {"n": 1})  # the tables are not empty: counts must not move
    before = written(db)
    overrides, message = API_CASES[case]
    job: dict[str, Any] = {"tenant": "acme", "kind": "demo.hello", "payload": None, **overrides}
    with pytest.raises(InvalidInput) as info:
        queue.enqueue(job.pop("tenant"), job.pop("kind"), job.pop("payload"), **job)
    assert str(info.value) == message
    assert written(db) == before


@pytest.mark.parametrize("case", ["nul-in-key", "lone-high-surrogate", "nested-100000",
                                  "tenant-trailing-newline"])
def test_one_hostile_job_rejects_the_whole_enqueue_many(queue: Queue, db: Database, case: str) -> None:
    overrides, message = API_CASES[case]
    bad = {"tenant": "beta", "kind": "demo.hello", "payload": None, **overrides}
    with pytest.raises(InvalidInput) as info:
        queue.enqueue_many([JobSpec(tenant="acme", kind="demo.hello"), bad])
    assert str(info.value) == f"job 1: {message}"
    assert written(db) == {"jobs": 0, "tenants": 0, "queues": 0}


def test_api_stores_a_payload_at_the_depth_limit(queue: Queue) -> None:
    at_limit = {"n": nested(MAX_PAYLOAD_DEPTH - 1)}  # a payload is an object: its level counts
    job_id = queue.enqueue("acme", "demo.hello", at_limit)
    assert queue.job(job_id).payload == at_limit


def test_api_stores_text_that_only_looks_like_a_nul(queue: Queue) -> None:
    payload = {"\\u0000": "\\\\u0000", "control": "\x01"}
    job_id = queue.enqueue("acme", "demo.hello", payload)
    assert queue.job(job_id).payload == payload


# -- the CLI -----------------------------------------------------------------

GOOD = {"--tenant": "acme", "--kind": "demo.hello"}
# case -> (options over a good job, the exact error line)
CLI_CASES: dict[str, tuple[dict[str, str], str]] = {
    "nul-in-value": ({"--payload": '{"text": "a\\u0000b"}'}, NUL),
    "nul-in-key": ({"--payload": '{"\\u0000": 1}'}, NUL),
    "nul-deep-inside": ({"--payload": '[1, {"x": [{"y": ["ok", "\\u0000"]}]}]'}, NUL),
    "lone-high-surrogate": ({"--payload": '{"s": "\\ud800"}'}, surrogate("\\ud800")),
    "lone-low-surrogate-key": ({"--payload": '{"\\udfff": 1}'}, surrogate("\\udfff")),
    "nested-990": ({"--payload": "[" * 990 + "]" * 990}, too_deep(990)),
    "nested-one-past-the-limit": ({"--payload": "[" * 65 + "]" * 65}, too_deep(65)),
    "tenant-trailing-newline": ({"--tenant": "acme\n"}, "tenant id 'acme\\n' is invalid"),
    "tenant-inner-newline": ({"--tenant": "ac\nme"}, "tenant id 'ac\\nme' is invalid"),
    "tenant-not-utf8": ({"--tenant": "acme\udcff"}, "tenant id 'acme\\udcff' is invalid"),
    "kind-trailing-newline": ({"--kind": "demo.hello\n"}, "kind 'demo.hello\\n' is invalid"),
    "key-not-utf8": ({"--key": "order\udcff"}, "idempotency key contains a lone surrogate (\\udcff)"),
}


def _enqueue_args(options: dict[str, str]) -> list[str]:
    return ["enqueue", *(part for item in {**GOOD, **options}.items() for part in item)]


def _rejected(cli: Cli, db: Database, args: list[str]) -> str:
    cli.ok("enqueue", "--tenant", "acme", "--kind", "demo.hello", "--payload", '{"n": 1}')
    before = written(db)
    res = cli.run(*args)
    assert res.returncode != 0, f"exit 0 for hostile input; stdout: {res.stdout[:200]}"
    assert res.stdout == ""
    line = one_error_line(res.stderr)
    assert written(db) == before
    return line


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_rejects_hostile_input_in_one_line_and_writes_nothing(cli: Cli, db: Database, case: str) -> None:
    options, message = CLI_CASES[case]
    line = _rejected(cli, db, _enqueue_args(options))
    assert line.startswith(f"error: {message}"), line


def test_cli_payload_file_100000_levels_deep(cli: Cli, db: Database, tmp_path: Path) -> None:
    # too long for one argument (the kernel's limit is 128 KiB), and too deep for json.loads
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    line = _rejected(cli, db, _enqueue_args({"--payload": f"@{deep}"}))
    assert line == f"error: {too_deep(100_000)}"


def test_cli_payload_file_that_is_not_utf8(cli: Cli, db: Database, tmp_path: Path) -> None:
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"name": "M\xfcller"}')
    line = _rejected(cli, db, _enqueue_args({"--payload": f"@{bad}"}))
    expected = f"error: cannot read the payload from file {bad}: 'utf-8' codec can't decode byte 0xfc"
    assert line.startswith(expected), line


def test_cli_accepts_a_payload_at_the_depth_limit(cli: Cli, queue: Queue) -> None:
    text = '{"n": ' + "[" * (MAX_PAYLOAD_DEPTH - 1) + "]" * (MAX_PAYLOAD_DEPTH - 1) + "}"
    job_id = int(cli.ok(*_enqueue_args({"--payload": text})).strip())
    payload: Any = queue.job(job_id).payload["n"]
    for _ in range(MAX_PAYLOAD_DEPTH - 2):
        (payload,) = payload
    assert payload == []
