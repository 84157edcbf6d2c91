"""Host functions from inline handlers: the same gate as a sandbox's calls
(tests/sandbox/test_host_functions.py), called in-process, with the same
JSON in and out and the same refusals; and the registration's one-line errors."""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any

import pytest

import tenantq
import tests.apps.hostfn  # noqa: F401  (registers the hostfn.* handlers and host functions)
from tenantq import JobSpec, Queue
from tenantq.errors import InvalidInput
from tenantq.host_functions import Caller, CallGate, CallLimits, limits_from_settings, merge_counts
from tenantq.observe import metrics
from tenantq.registry import REGISTRY, Registry
from tenantq.store.db import Database
from tenantq.tenant_data import AppDatabase
from tenantq.testing import drain, wait_until
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
    monkeypatch.setenv("TENANTQ_HOST_CALL_READ_TIMEOUT", "2.5")
    monkeypatch.setenv("TENANTQ_HOST_CALL_SPARE_CONNECTIONS", "0")
    limits = limits_from_settings()
    assert (limits.read_timeout, limits.spare_connections) == (2.5, 0)


def _gate(reg: Registry, kind: str, job_id: int = 1, **limits: Any) -> CallGate:
    return CallGate(reg, "acme", lambda: Caller(job_id, kind, None), limits=CallLimits(**limits))


def test_one_batchs_slow_calls_never_hold_up_another_batchs() -> None:
    """Each batch has threads of its own, as many as its calls in flight: 40
    calls stuck in ten other batches (more than any shared pool of 32) do
    not delay a call of an eleventh, and a call over a batch's bound is
    refused at once, never queued to run later."""
    reg = Registry()
    release = threading.Event()
    started: list[int] = []

    @tenantq.host_function("stuck", registry=reg)
    def stuck(args: dict[str, Any], ctx: tenantq.HostContext) -> int:
        started.append(ctx.job_id)
        release.wait(30)
        return 1

    tenantq.host_function("quick", registry=reg)(lambda args, ctx: 2)
    tenantq.handler("k", host_functions=["stuck", "quick"], registry=reg)(lambda payload, ctx: None)
    busy = [_gate(reg, "k", job_id=n, call_timeout=30) for n in range(10)]
    callers = [threading.Thread(target=g.call, args=("stuck", {})) for g in busy for _ in range(4)]
    try:
        for t in callers:
            t.start()
        wait_until(lambda: len(started) == 40, timeout=10, message="40 stuck calls running")
        t0 = time.monotonic()
        assert _gate(reg, "k", job_id=99, call_timeout=1).call("quick", {}) == {"ok": True, "result": 2}
        assert time.monotonic() - t0 < 1.0
        assert busy[0].call("quick", {}) == {
            "ok": False, "error": "refused: 4 calls of this batch are already running"}
    finally:
        release.set()
        for t in callers:
            t.join(timeout=30)
        for g in busy:
            g.close()
    assert len(started) == 40, "a refused call ran later"
    assert busy[0].call("quick", {}) == {"ok": False, "error": "refused: the batch has ended"}


def test_a_declared_function_no_worker_registered_is_refused_and_counted_in_the_metrics() -> None:
    reg = Registry()
    tenantq.host_function("metered", registry=reg)(lambda args, ctx: 1)
    tenantq.handler("k", host_functions=["metered", "ghost"], registry=reg)(lambda payload, ctx: None)
    gate = _gate(reg, "k")

    def sample(name: str, **labels: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    before = (sample("tenantq_host_function_calls_total", function="metered", outcome="ok"),
              sample("tenantq_host_function_calls_total", function="unknown", outcome="refused"),
              sample("tenantq_host_function_seconds_count", function="metered"))
    assert gate.call("ghost", {}) == {
        "ok": False, "error": "refused: no host function 'ghost' is registered on this worker"}
    assert gate.call("metered", {}) == {"ok": True, "result": 1}
    after = (sample("tenantq_host_function_calls_total", function="metered", outcome="ok"),
             sample("tenantq_host_function_calls_total", function="unknown", outcome="refused"),
             sample("tenantq_host_function_seconds_count", function="metered"))
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]
    gate.close()


def test_the_records_of_a_batchs_two_gates_add_up() -> None:
    first = {"calls": 3, "refused": 1, "errors": 0, "bytes_in": 10, "bytes_out": 5, "seconds": 0.25}
    second = {"calls": 2, "refused": 0, "errors": 2, "bytes_in": 4, "bytes_out": 0, "seconds": 0.5}
    assert merge_counts(None, second) == second
    assert merge_counts(first, second) == {"calls": 5, "refused": 1, "errors": 2, "bytes_in": 14,
                                           "bytes_out": 5, "seconds": 0.75}


def test_a_worker_started_with_app_db_flags_scopes_its_inline_calls(
        db: Database, app_schema: AppSchema, cli_env: dict[str, str], tenantq_cmd: list[str]) -> None:
    """--app-db as a login that may take the reader role (here the
    superuser), --app-db-role the reader (neither owner nor superuser): RLS
    scopes every call all the same."""
    with Queue(db.dsn, schema=db.schema) as q:
        job = q.enqueue("globex", "hostfn.report", {"other": "acme"})
        env = {**cli_env, "TQ_TEST_APP_SCHEMA": app_schema.schema}
        argv = [*tenantq_cmd, "worker", "--app", "tests.apps.hostfn", "--sandbox", "inline", "--once",
                "--app-db", app_schema.superuser_url, "--app-db-role", app_schema.reader]
        res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert res.returncode == 0, res.stderr[-2000:]
        result = q.job(job).result
    assert result["mine"] == {"ids": ROWS["globex"], "tenant": "globex", "actor": None, "setting": "globex"}
