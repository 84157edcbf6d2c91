"""Host functions from inline handlers: the same gate as a sandbox's calls
(tests/sandbox/test_host_functions.py), called in-process, with the same
JSON in and out and the same refusals; and the registration's one-line errors."""

from __future__ import annotations

import pytest

import tenantq
import tests.apps.hostfn  # noqa: F401  (registers the hostfn.* handlers and host functions)
from tenantq import JobSpec, Queue
from tenantq.errors import InvalidInput
from tenantq.host_functions import CallLimits
from tenantq.registry import REGISTRY, Registry
from tenantq.store.db import Database
from tenantq.tenant_data import AppDatabase
from tenantq.testing import drain
from tests.appdb import ROWS, AppSchema


def test_an_inline_handler_calls_its_host_functions_through_the_same_gate(
        db: Database, app_schema: AppSchema, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQ_TEST_APP_SCHEMA", app_schema.schema)
    with Queue(db.dsn, schema=db.schema) as q:
        report, flood = q.enqueue_many([
            JobSpec(tenant="globex", kind="hostfn.report", payload={"other": "acme"}, actor="usr_3"),
            JobSpec(tenant="acme", kind="hostfn.flood", payload={"calls": 1003})])
        with AppDatabase(app_schema.config()) as app_db:
            drain(db, REGISTRY, app_db=app_db)
        job, flooded = q.job(report), q.job(flood)
    assert job.status == "done", job.last_error
    expected = {"ids": ROWS["globex"], "tenant": "globex", "actor": "usr_3", "setting": "globex"}
    r = job.result
    assert r["mine"] == expected and r["after_switch"] == expected, r
    assert r["undeclared"] == {"error": "refused: handler 'hostfn.report' does not declare host function "
                                        "'orders.everyone'"}
    assert r["boom"] == {"error": "boom raised ValueError: no such month"}
    assert r["slow"] == {"error": "slow: no answer within 0.5 s"}
    assert r["huge_args"]["error"].startswith("refused: args of 10485"), r["huge_args"]
    assert r["not_an_object"] == {"error": "refused: args must be a JSON object"}
    assert flooded.result == {"ok": 1000, "errors": ["refused: this batch made its 1000 calls"]}


def test_bad_registrations_and_limits_are_one_line() -> None:
    reg = Registry()
    with pytest.raises(InvalidInput, match=r"^host function name 'no spaces' is invalid"):
        tenantq.host_function("no spaces", registry=reg)
    with pytest.raises(InvalidInput, match=r"^host function 'f': timeout must be in \(0, 3600\] s"):
        tenantq.host_function("f", timeout=0, registry=reg)
    with pytest.raises(InvalidInput, match=r"^host function name '' is invalid"):
        tenantq.handler("k", host_functions=[""], registry=reg)
    tenantq.host_function("f", registry=reg)(lambda args, ctx: 1)
    with pytest.raises(InvalidInput, match=r"^host function 'f' is already registered"):
        tenantq.host_function("f", registry=reg)(lambda args, ctx: 2)
    with pytest.raises(InvalidInput, match=r"^host function limit calls_per_batch must be at least 1"):
        CallLimits(calls_per_batch=0)


def test_the_limits_are_the_settings(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENANTQ_HOST_CALLS_PER_BATCH", "5")
    with Queue(db.dsn, schema=db.schema) as q:
        flood = q.enqueue("acme", "hostfn.flood", {"calls": 7})
        drain(db, REGISTRY)
        assert q.job(flood).result == {"ok": 5, "errors": ["refused: this batch made its 5 calls"]}
