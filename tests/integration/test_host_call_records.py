"""What host-function calls leave on the record (docs/tenant-data.md,
"Accounting"): each attempt's calls (name, outcome, time), listed by
`tenantq job ID` and the job page; each batch's counts; and a tenant's own
restriction of the functions its handlers may call (`tenantq tenant set T
--host-functions`), which the gate applies from the host's record of the
batch's tenant, never from the call."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

import tests.apps.hostfn  # noqa: F401  (registers the hostfn.* handlers and host functions)
from tenantq import Queue
from tenantq.errors import InvalidInput
from tenantq.host_functions import MAX_RECORDED_CALLS
from tenantq.registry import REGISTRY
from tenantq.store.db import Database
from tenantq.testing import drain
from tests.acceptance.helpers import query

REFUSED_UNDECLARED = "refused: handler 'hostfn.mixed' does not declare host function 'orders.everyone'"


def _batch_calls(db: Database, job_id: int) -> Any:
    rows = query(db, "SELECT b.host_calls FROM batches b JOIN attempts a ON a.tenant_id = b.tenant_id "
                     "WHERE a.job_id = %(job)s AND b.worker_id = a.worker_id "
                     "ORDER BY b.batch_id DESC LIMIT 1", {"job": job_id})
    return rows[0]["host_calls"]


def test_an_attempt_lists_its_calls_and_its_batch_counts_them(
        db: Database, cli_env: dict[str, str], tenantq_cmd: list[str]) -> None:
    with Queue(db.dsn, schema=db.schema) as q:
        job = q.enqueue("acme", "hostfn.mixed")
        drain(db, REGISTRY)
        info = q.job(job)
    assert info.status == "done", info.last_error
    assert info.result["orders.everyone"] == {"error": REFUSED_UNDECLARED}
    (attempt,) = info.attempts_history
    record = attempt["host_calls"]
    assert (record["count"], record["errors"]) == (3, 2), record
    assert [(c["name"], c["outcome"]) for c in record["calls"]] == [
        ("noop", "ok"), ("boom", "error"), ("orders.everyone", "refused")]
    assert all(c["ms"] >= 0 for c in record["calls"]) and record["seconds"] >= 0
    batch = _batch_calls(db, job)
    # two let through (one failed), one refused; bytes as the host measured them
    assert (batch["calls"], batch["errors"], batch["refused"]) == (2, 1, 1), batch
    assert batch["bytes_in"] == 2 * len(json.dumps({"pad": "x" * 100})), batch
    assert batch["bytes_out"] == len("1"), batch  # noop's result; boom's error is not a result
    assert batch["seconds"] >= 0

    shown = subprocess.run([*tenantq_cmd, "job", str(job)], env=cli_env, capture_output=True, text=True,
                           timeout=60, check=True).stdout
    assert "3 call(s), 2 not ok" in shown, shown
    for line in ("noop: ok in", "boom: error in", "orders.everyone: refused in"):
        assert line in shown, shown


def test_an_attempt_lists_its_first_calls_and_counts_them_all(db: Database) -> None:
    with Queue(db.dsn, schema=db.schema) as q:
        job = q.enqueue("acme", "hostfn.flood", {"calls": MAX_RECORDED_CALLS + 20})
        drain(db, REGISTRY)
        (attempt,) = q.job(job).attempts_history
    record = attempt["host_calls"]
    assert record["count"] == MAX_RECORDED_CALLS + 20 and len(record["calls"]) == MAX_RECORDED_CALLS
    assert _batch_calls(db, job)["calls"] == MAX_RECORDED_CALLS + 20


def test_names_no_function_can_have_are_recorded_as_a_question_mark(db: Database) -> None:
    """The guest's string reaches the attempt's row only if it is a valid
    name: a NUL byte there would make Postgres refuse the whole settle."""
    with Queue(db.dsn, schema=db.schema) as q:
        job = q.enqueue("acme", "hostfn.badnames")
        drain(db, REGISTRY)
        info = q.job(job)
    assert info.status == "done" and info.result == 4, (info.status, info.last_error)
    (attempt,) = info.attempts_history
    assert [(c["name"], c["outcome"]) for c in attempt["host_calls"]["calls"]] == [("?", "refused")] * 4


def test_a_job_that_calls_nothing_records_nothing(db: Database) -> None:
    with Queue(db.dsn, schema=db.schema) as q:
        job = q.enqueue("acme", "hostfn.flood", {"calls": 0})
        drain(db, REGISTRY)
        (attempt,) = q.job(job).attempts_history
    assert attempt["host_calls"] is None and _batch_calls(db, job) is None


def test_a_tenant_restriction_refuses_what_its_handlers_declare(db: Database, cli_env: dict[str, str],
                                                               tenantq_cmd: list[str]) -> None:
    def run(*args: str) -> str:
        return subprocess.run([*tenantq_cmd, *args], env=cli_env, capture_output=True, text=True, timeout=60,
                              check=True).stdout

    said = run("tenant", "set", "acme", "--host-functions", "boom")
    assert "host functions: boom" in said, said
    with Queue(db.dsn, schema=db.schema) as q:
        restricted, other = q.enqueue("acme", "hostfn.mixed"), q.enqueue("globex", "hostfn.mixed")
        drain(db, REGISTRY)
        r, o = q.job(restricted).result, q.job(other).result
        assert r["noop"] == {"error": "refused: tenant 'acme' may not call host function 'noop' "
                                      "(tenantq tenant set --host-functions)"}, r
        assert r["boom"] == {"error": "boom raised ValueError: no such month"}
        assert r["orders.everyone"] == {"error": REFUSED_UNDECLARED}  # declared first, then the tenant
        assert o["noop"] == {"ok": 1}, o  # another tenant is not restricted

        assert "host functions: none" in run("tenant", "set", "acme", "--host-functions", "")
        none = q.enqueue("acme", "hostfn.mixed")
        drain(db, REGISTRY)
        assert q.job(none).result["boom"]["error"].startswith("refused: tenant 'acme' may not call")

        assert "host functions: every declared one" in run("tenant", "set", "acme", "--host-functions", "*")
        lifted = q.enqueue("acme", "hostfn.mixed")
        drain(db, REGISTRY)
        assert q.job(lifted).result["noop"] == {"ok": 1}
        # a setting not named is left as it is
        assert "host functions" not in run("tenant", "set", "acme", "--weight", "2")
        assert q.tenants("acme")[0]["host_functions"] is None


@pytest.mark.parametrize(("value", "message"), [
    ("ok, no spaces", r"^host function name 'no spaces' is invalid"),
    ("*,noop", r'^--host-functions: "\*" \(every declared function\) stands alone$'),
    (",".join(f"f{i}" for i in range(300)), r"^--host-functions: at most 256 names, got 300$"),
])
def test_a_bad_restriction_is_one_line_and_changes_nothing(db: Database, cli_env: dict[str, str],
                                                          tenantq_cmd: list[str], value: str,
                                                          message: str) -> None:
    with Queue(db.dsn, schema=db.schema) as q:
        q.set_tenant("acme", host_functions="noop")
        with pytest.raises(InvalidInput, match=message):
            q.set_tenant("acme", host_functions=value)
        res = subprocess.run([*tenantq_cmd, "tenant", "set", "acme", "--host-functions", value], env=cli_env,
                             capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert q.tenants("acme")[0]["host_functions"] == ["noop"]
