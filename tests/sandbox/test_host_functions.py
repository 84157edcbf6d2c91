"""Host functions from sandboxed handlers (docs/tenant-data.md, rule F1 of
docs/security.md), on both drivers through `tenantq worker`: a handler's
`ctx.call` reaches only the host functions it declares, which run in the
dispatcher in the batch's tenant and the job's actor (never what the args
say) on a real FORCE ROW LEVEL SECURITY schema; every refusal and failure
is one clear error in the job, and the batch's other jobs run normally."""

from __future__ import annotations

from typing import Any

from tenantq import JobSpec, Queue
from tests.acceptance.helpers import Cli
from tests.appdb import ROWS, AppSchema
from tests.sandbox.conftest import worker_args

APP = "tests.apps.hostfn"
WORKER_TIMEOUT = 180.0


def _worker(cli: Cli, driver_name: str, app_schema: AppSchema, *extra: str) -> None:
    cli.env = {**cli.env, "TENANTQ_APP_DATABASE_URL": app_schema.login_url,
               "TQ_TEST_APP_SCHEMA": app_schema.schema}
    res = cli.run(*worker_args(APP, driver_name, "--once", "--backoff-base", "0", *extra),
                  timeout=WORKER_TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]


def test_a_sandboxed_handler_calls_only_its_host_functions_in_its_tenant(
        driver_name: str, cli: Cli, queue: Queue, app_schema: AppSchema) -> None:
    ids = queue.enqueue_many([
        JobSpec(tenant="acme", kind="hostfn.report", payload={"other": "globex"}, actor="usr_7"),
        JobSpec(tenant="acme", kind="hostfn.nocalls"),
        JobSpec(tenant="globex", kind="hostfn.report", payload={"other": "acme"}),
    ])
    _worker(cli, driver_name, app_schema, "--batch-size", "5", "--concurrency", "1")
    acme, nocalls, globex = (queue.job(i) for i in ids)
    assert acme.status == "done" and globex.status == "done", (acme.last_error, globex.last_error)
    for job, tenant, actor in ((acme.result, "acme", "usr_7"), (globex.result, "globex", None)):
        expected = {"ids": ROWS[tenant], "tenant": tenant, "actor": actor, "setting": tenant}
        assert job["mine"] == expected, job["mine"]
        # a host function that sets the tenant for its session changes nothing for the next call
        assert job["switch"] == {"ok": True} and job["after_switch"] == expected, job
        assert job["undeclared"] == {"error": "refused: handler 'hostfn.report' does not declare host "
                                              "function 'orders.everyone'"}, job
        assert job["unknown"]["error"].startswith("refused: handler 'hostfn.report' does not declare"), job
        assert job["boom"] == {"error": "boom raised ValueError: no such month"}, job
        assert job["slow"] == {"error": "slow: no answer within 0.5 s"}, job
        assert job["big"]["error"].startswith("big returned 2097154 bytes; the limit is 1048576"), job
        assert job["huge_args"]["error"].startswith("ctx.call('noop'): a request of 10485"), job
        assert job["not_an_object"] == {"error": "refused: args must be a JSON object"}, job
    assert nocalls.status == "done", nocalls.last_error
    result: dict[str, Any] = nocalls.result
    assert result["ctx"] == {"error": "ctx.call('orders.for_month'): handler 'hostfn.nocalls' declares no "
                                      "host functions"}, result
    # the host's check, not ctx.call's: the job wrote the request on the socket itself
    assert result["raw"] == {"ok": False, "error": "refused: handler 'hostfn.nocalls' does not declare "
                                                   "host function 'orders.for_month'"}, result


def test_a_batch_gets_its_stated_number_of_calls(driver_name: str, cli: Cli, queue: Queue,
                                                  app_schema: AppSchema) -> None:
    """10,000 calls: the first 1,000 answered, the rest refused in one line
    each, while the other tenant's batch beside it runs normally."""
    flood, echo = queue.enqueue_many([JobSpec(tenant="acme", kind="hostfn.flood", payload={"calls": 10_000}),
                                      JobSpec(tenant="acme", kind="hostfn.nocalls")])
    neighbour = queue.enqueue("globex", "hostfn.report", {"other": "acme"})
    _worker(cli, driver_name, app_schema, "--batch-size", "5", "--concurrency", "2")
    info = queue.job(flood)
    assert info.status == "done", info.last_error
    assert info.result == {"ok": 1000, "errors": ["refused: this batch made its 1000 calls"]}, info.result
    assert info.attempts_history[-1]["host_calls"]["count"] == 10_000
    assert queue.job(echo).status == "done"
    other = queue.job(neighbour)
    assert other.status == "done" and other.result["mine"]["ids"] == ROWS["globex"], other


def test_the_calls_of_sandboxed_jobs_are_on_their_attempts_and_their_batch(
        driver_name: str, cli: Cli, queue: Queue, app_schema: AppSchema) -> None:
    """Counted by the host per job of the batch (the connection's job as the
    host recorded it), with the tenant's own restriction applied."""
    queue.set_tenant("acme", host_functions="noop,boom")
    mixed, flood = queue.enqueue_many([JobSpec(tenant="acme", kind="hostfn.mixed"),
                                       JobSpec(tenant="acme", kind="hostfn.flood", payload={"calls": 5})])
    queue.set_tenant("globex", host_functions="boom")
    restricted = queue.enqueue("globex", "hostfn.mixed")
    _worker(cli, driver_name, app_schema, "--batch-size", "5", "--concurrency", "1")
    first, second, third = (queue.job(i) for i in (mixed, flood, restricted))
    calls = [(c["name"], c["outcome"]) for c in first.attempts_history[-1]["host_calls"]["calls"]]
    assert calls == [("noop", "ok"), ("boom", "error"), ("orders.everyone", "refused")], first
    assert second.attempts_history[-1]["host_calls"]["count"] == 5, second.attempts_history
    assert third.result["noop"]["error"].startswith("refused: tenant 'globex' may not call"), third
    with queue.db.connect() as conn:
        rows = conn.execute("SELECT tenant_id, host_calls FROM batches ORDER BY batch_id").fetchall()
    by_tenant = {r["tenant_id"]: r["host_calls"] for r in rows}
    assert {k: by_tenant["acme"][k] for k in ("calls", "errors", "refused")} == \
        {"calls": 7, "errors": 1, "refused": 1}, by_tenant
    assert {k: by_tenant["globex"][k] for k in ("calls", "errors", "refused")} == \
        {"calls": 1, "errors": 1, "refused": 2}, by_tenant
