"""The `tenantq` command line, run as real subprocesses against Postgres."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from tenantq import JobSpec, Queue
from tenantq.store import jobs as store_jobs
from tenantq.store.db import Database
from tests.acceptance.helpers import Cli, one_error_line, query, status_counts


def _queues_by_key(status: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["tenant_id"], r["priority"]): r for r in status["queues"]}


def _tenants_by_id(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["tenant_id"]: t for t in status["tenants"]}


# -- migrate ---------------------------------------------------------------

def test_migrate_installs_then_is_up_to_date(cli: Cli, db: Database) -> None:
    schema = f"{db.schema}_m"
    cli.env = {**cli.env, "TENANTQ_SCHEMA": schema}
    try:
        first = cli.ok("migrate")
        assert schema in first
        assert "up to date" not in first
        second = cli.ok("migrate")
        assert "up to date" in second, second
        # and the fresh schema really works
        assert cli.ok("enqueue", "--tenant", "acme", "--kind", "demo.noop").strip().isdigit()
    finally:
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(schema)))


def test_migrate_on_migrated_schema_is_up_to_date(cli: Cli) -> None:
    assert "up to date" in cli.ok("migrate")
    assert "up to date" in cli.ok("migrate")


# -- enqueue ---------------------------------------------------------------

def test_enqueue_prints_the_job_id(cli: Cli, queue: Queue) -> None:
    out = cli.ok("enqueue", "--tenant", "acme", "--kind", "demo.hello", "--payload", '{"n": 1}',
                 "--priority", "interactive", "--max-attempts", "3")
    assert out.strip().isdigit(), out
    job_id = int(out)
    info = queue.job(job_id)
    assert (info.tenant_id, info.kind, info.payload, info.priority, info.max_attempts, info.status) == (
        "acme", "demo.hello", {"n": 1}, "interactive", 3, "pending")
    second = int(cli.ok("enqueue", "--tenant", "acme", "--kind", "demo.hello"))
    assert second != job_id


def test_enqueue_with_the_same_key_prints_the_same_id(cli: Cli, queue: Queue) -> None:
    args = ("enqueue", "--tenant", "acme", "--kind", "demo.hello", "--key", "order-42")
    first = int(cli.ok(*args, "--payload", '{"v": 1}'))
    again = int(cli.ok(*args, "--payload", '{"v": 2}'))
    assert again == first
    # the same key in another tenant is another job
    other = int(cli.ok("enqueue", "--tenant", "globex", "--kind", "demo.hello", "--key", "order-42"))
    assert other != first
    rows = {(r["tenant_id"], r["priority"]): r["pending"] for r in queue.status()}
    assert rows == {("acme", "default"): 1, ("globex", "default"): 1}
    assert queue.job(first).payload == {"v": 1}


# A payload whose JSON is over 256 KiB cannot be one argv string on Linux
# (MAX_ARG_STRLEN is 128 KiB, exec fails with E2BIG), and the CLI takes the
# payload only as an argument. So the argument is ~117 KiB of numbers that
# serialise to ~470 KiB: 1e15 is rendered as "1000000000000000.0".
OVERSIZE_PAYLOAD = "[" + ",".join(["1e15"] * 24_000) + "]"

BAD_ENQUEUES: dict[str, tuple[list[str], str]] = {
    "bad-tenant": (["--tenant", "bad tenant!", "--kind", "demo.hello"], "tenant"),
    "empty-tenant": (["--tenant", "", "--kind", "demo.hello"], "tenant"),
    "non-json-payload": (["--tenant", "acme", "--kind", "demo.hello", "--payload", "{not json"], "json"),
    "unknown-priority": (["--tenant", "acme", "--kind", "demo.hello", "--priority", "urgent"], "priority"),
    "zero-max-attempts": (["--tenant", "acme", "--kind", "demo.hello", "--max-attempts", "0"], "attempts"),
    "negative-delay": (["--tenant", "acme", "--kind", "demo.hello", "--delay", "-5"], "delay"),
    "oversize-payload": (["--tenant", "acme", "--kind", "demo.hello", "--payload", OVERSIZE_PAYLOAD],
                         "payload"),
}


@pytest.mark.parametrize("case", list(BAD_ENQUEUES))
def test_bad_enqueue_is_one_error_line_and_writes_nothing(cli: Cli, queue: Queue, case: str) -> None:
    args, topic = BAD_ENQUEUES[case]
    res = cli.run("enqueue", *args)
    assert res.returncode != 0
    line = one_error_line(res.stderr)
    assert topic in line.lower(), line
    assert res.stdout == ""
    assert queue.status() == []
    assert queue.tenants() == []


def test_bad_enqueue_leaves_existing_jobs_alone(cli: Cli, db: Database, queue: Queue) -> None:
    job_id = queue.enqueue("acme", "demo.hello")
    before = status_counts(db)
    res = cli.run("enqueue", "--tenant", "acme", "--kind", "demo.hello", "--payload", "[1,")
    assert res.returncode != 0
    one_error_line(res.stderr)
    assert status_counts(db) == before == {"pending": 1}
    assert queue.job(job_id).status == "pending"


# -- worker --once, status, job ------------------------------------------------

def test_worker_once_drains_every_tenant_and_status_counts_them(cli: Cli, queue: Queue) -> None:
    plan = {("acme", "interactive"): 2, ("acme", "default"): 3, ("globex", "bulk"): 4,
            ("initech", "default"): 1}
    ids = queue.enqueue_many([JobSpec(tenant=t, kind="demo.hello", payload={"i": i}, priority=p)
                              for (t, p), n in plan.items() for i in range(n)])
    failing = int(cli.ok("enqueue", "--tenant", "globex", "--kind", "demo.fail", "--max-attempts", "1"))

    res = cli.worker("--once", "--concurrency", "2", "--batch-size", "2")
    assert res.returncode == 0, res.stderr[-3000:]

    assert all(queue.job(i).status == "done" for i in ids)
    assert queue.job(failing).status == "dead"

    status = cli.json("status")
    queues = _queues_by_key(status)
    assert set(queues) == set(plan) | {("globex", "default")}
    for key, n in plan.items():
        row = queues[key]
        assert (row["pending"], row["running"], row["done"], row["dead"]) == (0, 0, n, 0), row
    assert queues[("globex", "default")]["dead"] == 1
    assert set(_tenants_by_id(status)) == {"acme", "globex", "initech"}
    assert status["running_batches"] == []

    only = cli.json("status", "--tenant", "globex")
    assert {r["tenant_id"] for r in only["queues"]} == {"globex"}

    table = cli.ok("status")
    for tenant in ("acme", "globex", "initech"):
        assert tenant in table, table


def test_job_json_shows_status_attempts_error_and_result(cli: Cli, queue: Queue) -> None:
    ok_id = int(cli.ok("enqueue", "--tenant", "acme", "--kind", "demo.hello", "--payload", '{"x": 7}'))
    bad_id = int(cli.ok("enqueue", "--tenant", "acme", "--kind", "demo.fail", "--max-attempts", "2"))
    res = cli.worker("--once", "--backoff-base", "0")
    assert res.returncode == 0, res.stderr[-3000:]

    done = cli.json("job", str(ok_id))
    assert done["id"] == ok_id
    assert done["status"] == "done"
    assert done["attempts"] == 1
    assert done["last_error"] is None
    assert done["result"] == {"hello": "acme", "job": ok_id, "attempt": 1, "payload": {"x": 7}}

    dead = cli.json("job", str(bad_id))
    assert dead["status"] == "dead"
    assert dead["attempts"] == 2
    assert "boom on attempt 2" in dead["last_error"]
    assert dead["result"] is None

    panel = cli.ok("job", str(ok_id))
    assert "done" in panel


def test_job_explains_why_a_delayed_job_waits(cli: Cli) -> None:
    job_id = int(cli.ok("enqueue", "--tenant", "acme", "--kind", "demo.hello", "--delay", "300"))
    info = cli.json("job", str(job_id))
    assert info["status"] == "pending"
    run_after = datetime.fromisoformat(info["run_after"])
    assert run_after > datetime.now(UTC) + timedelta(seconds=200)
    assert any("future" in reason for reason in info["why_waiting"]), info["why_waiting"]

    # a worker leaves it alone
    res = cli.worker("--once")
    assert res.returncode == 0, res.stderr[-3000:]
    assert cli.json("job", str(job_id))["status"] == "pending"

    panel = cli.ok("job", str(job_id))
    assert "future" in panel, panel


def test_unknown_job_is_one_error_line(cli: Cli) -> None:
    for args in (["job", "999999"], ["job", "999999", "--json"]):
        res = cli.run(*args)
        assert res.returncode != 0
        assert "999999" in one_error_line(res.stderr)
        assert res.stdout == ""


# -- dead letters ------------------------------------------------------------

def test_dead_list_and_retry(cli: Cli, queue: Queue) -> None:
    acme = queue.enqueue_many([JobSpec(tenant="acme", kind="demo.fail", max_attempts=2)] * 2)
    globex = queue.enqueue_many([JobSpec(tenant="globex", kind="demo.fail", max_attempts=3)] * 2)
    res = cli.worker("--once", "--backoff-base", "0")
    assert res.returncode == 0, res.stderr[-3000:]

    listed = cli.json("dead", "list")
    assert {r["id"] for r in listed} == {*acme, *globex}
    by_id = {r["id"]: r for r in listed}
    for job_id in acme:
        assert by_id[job_id]["attempts"] == 2
        assert "boom on attempt 2" in by_id[job_id]["last_error"]
    for job_id in globex:
        assert by_id[job_id]["attempts"] == 3
    assert {r["id"] for r in cli.json("dead", "list", "--tenant", "acme")} == set(acme)
    assert "acme" in cli.ok("dead", "list")

    # one job by id
    cli.ok("dead", "retry", str(acme[0]))
    replayed = queue.job(acme[0])
    assert (replayed.status, replayed.attempts) == ("pending", 0)
    assert queue.job(acme[1]).status == "dead"

    # a job that is not dead: one error line, nothing changes
    res = cli.run("dead", "retry", str(acme[0]))
    assert res.returncode != 0
    one_error_line(res.stderr)
    assert queue.job(acme[0]).status == "pending"

    # all of one tenant
    out = cli.ok("dead", "retry", "--all", "--tenant", "globex")
    assert "2" in out
    for job_id in globex:
        info = queue.job(job_id)
        assert (info.status, info.attempts) == ("pending", 0)
    assert queue.job(acme[1]).status == "dead"
    assert {r["id"] for r in cli.json("dead", "list")} == {acme[1]}

    # neither an id nor --all
    res = cli.run("dead", "retry")
    assert res.returncode != 0
    one_error_line(res.stderr)

    # replayed jobs run again
    res = cli.worker("--once", "--backoff-base", "0")
    assert res.returncode == 0, res.stderr[-3000:]
    assert queue.job(acme[0]).attempts == 2
    assert queue.job(globex[0]).attempts == 3


# -- cancel ------------------------------------------------------------------

def test_cancel_pending_job_and_refuse_a_done_one(cli: Cli, queue: Queue) -> None:
    pending = queue.enqueue("acme", "demo.hello", delay=600)
    done = queue.enqueue("acme", "demo.hello")
    assert cli.worker("--once").returncode == 0
    assert queue.job(done).status == "done"

    cli.ok("cancel", str(pending))
    assert queue.job(pending).status == "cancelled"

    res = cli.run("cancel", str(done))
    assert res.returncode != 0
    one_error_line(res.stderr)
    assert queue.job(done).status == "done"

    res = cli.run("cancel", "999999")
    assert res.returncode != 0
    one_error_line(res.stderr)

    rows = {(r["tenant_id"], r["priority"]): r for r in cli.json("status")["queues"]}
    assert (rows[("acme", "default")]["cancelled"], rows[("acme", "default")]["done"]) == (1, 1)


# -- tenants, reap -------------------------------------------------------------

def test_tenant_set_shows_in_status(cli: Cli) -> None:
    cli.ok("tenant", "set", "acme", "--weight", "3", "--max-sandboxes", "2")
    tenants = _tenants_by_id(cli.json("status"))
    assert (tenants["acme"]["weight"], tenants["acme"]["max_sandboxes"]) == (3, 2)

    # leaving an option out keeps it; --max-sandboxes 0 removes the cap
    cli.ok("tenant", "set", "acme", "--max-sandboxes", "0")
    tenants = _tenants_by_id(cli.json("status", "--tenant", "acme"))
    assert (tenants["acme"]["weight"], tenants["acme"]["max_sandboxes"]) == (3, None)

    res = cli.run("tenant", "set", "bad tenant!", "--weight", "2")
    assert res.returncode != 0
    one_error_line(res.stderr)
    assert set(_tenants_by_id(cli.json("status"))) == {"acme"}


def test_tenant_egress_rules(cli: Cli) -> None:
    out = cli.ok("tenant", "set", "acme", "--egress", "api.stripe.com, *.salesforce.com:443")
    assert out.strip().endswith("egress api.stripe.com, *.salesforce.com:443")
    assert _tenants_by_id(cli.json("status"))["acme"]["egress"] == ["api.stripe.com", "*.salesforce.com:443"]
    assert "api.stripe.com" in cli.ok("status")
    # other settings leave the rules alone; "" removes them
    cli.ok("tenant", "set", "acme", "--weight", "2")
    assert _tenants_by_id(cli.json("status"))["acme"]["egress"] == ["api.stripe.com", "*.salesforce.com:443"]
    for bad, message in (("exa mple.com", "not a host name"), ("ok.com:70000", "port must be 1-65535")):
        res = cli.run("tenant", "set", "acme", "--egress", bad)
        assert res.returncode == 1 and message in one_error_line(res.stderr)
    assert _tenants_by_id(cli.json("status"))["acme"]["egress"] == ["api.stripe.com", "*.salesforce.com:443"]
    assert cli.ok("tenant", "set", "acme", "--egress", "").strip().endswith("egress none")
    assert _tenants_by_id(cli.json("status"))["acme"]["egress"] == []


def test_reap_puts_back_jobs_of_an_expired_lease(cli: Cli, db: Database, queue: Queue) -> None:
    assert cli.ok("reap").startswith("reaped 0")

    # a job enqueued two minutes ago, leased a minute ago for one second by
    # a worker that is gone: the lease is long expired
    now = datetime.now(UTC)
    job_id = queue.enqueue("acme", "demo.hello", now=now - timedelta(seconds=120))
    with db.connect() as conn:
        batch = store_jobs.claim(conn, tenant_id="acme", priority="default", limit=10,
                                 worker_id="gone-worker", driver="inline", lease_seconds=1,
                                 now=now - timedelta(seconds=60))
    assert batch is not None and [j.id for j in batch.jobs] == [job_id]
    assert queue.job(job_id).status == "running"

    out = cli.ok("reap")
    assert out.startswith("reaped 1"), out
    info = queue.job(job_id)
    assert (info.status, info.attempts, info.batch_id) == ("pending", 1, None)
    assert "gone-worker" in (info.last_error or "")
    assert query(db, "SELECT count(*) AS n FROM batches WHERE ended_at IS NULL")[0]["n"] == 0


def test_status_json_is_valid_on_an_empty_queue(cli: Cli) -> None:
    status = cli.json("status")
    assert status == {"queues": [], "tenants": [], "running_batches": [], "schedules": []}
    json.dumps(status)
