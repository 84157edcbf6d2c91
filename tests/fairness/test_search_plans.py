"""Query-plan tests for finding jobs (sql/search.sql), as
test_query_plans.py does for the claim path: on 20,000 jobs over 50 tenants
(ANALYZEd, so the planner's choice means something), every statement with
a tenant filter, alone or with the other filters, reads an index whose
first column is tenant_id and never scans the jobs table; without a tenant,
a page is read off the primary key backwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, LiteralString

import pytest
from psycopg import sql as pgsql

from tenantq.store import search
from tenantq.store.db import Database
from tenantq.testing import drop_schema, isolated_schema

TENANTS = 50
JOBS = 20_000


def _seed(db: Database) -> None:
    # ~70% done, 12% pending, 8% dead, 10% cancelled; a third with an actor
    # (ten per tenant), a fifth with meta; created over the last 30 days
    with db.connect() as conn:
        conn.execute(f"""
            INSERT INTO tenants (tenant_id) SELECT 't' || g FROM generate_series(1, {TENANTS}) g;
            INSERT INTO jobs (tenant_id, kind, payload, priority, run_after, created_at, status,
                              finished_at, last_error, attempts, actor, meta)
            SELECT 't' || (g % {TENANTS} + 1), 'kind.' || (n % 7), '{{}}'::jsonb,
                   (ARRAY['interactive', 'default', 'bulk'])[n % 3 + 1],
                   now(), now() - make_interval(secs => (g * 129.6)::float8), s.status,
                   CASE WHEN s.status <> 'pending' THEN now() - make_interval(secs => g) END,
                   CASE WHEN s.status = 'dead' THEN E'boom\\ntraceback' END,
                   CASE WHEN s.status = 'pending' THEN 0 ELSE 1 END,
                   CASE WHEN n % 3 = 0 THEN 'user-' || (n / 3 % 10) END,
                   CASE WHEN n % 5 = 0 THEN jsonb_build_object('plan', CASE WHEN n / 5 % 2 = 0 THEN 'pro'
                                                                       ELSE 'free' END,
                                                               'request_id', 'r-' || g) END
            FROM generate_series(1, {JOBS}) g,
                 -- n: the job's number within its tenant, so each tenant has every mix
                 LATERAL (SELECT g / {TENANTS} AS n) AS i,
                 LATERAL (SELECT CASE WHEN n % 100 < 70 THEN 'done' WHEN n % 100 < 82 THEN 'pending'
                                      WHEN n % 100 < 90 THEN 'dead' ELSE 'cancelled' END AS status) s;
            ANALYZE;
        """)


@pytest.fixture(scope="module")
def seeded() -> Iterator[Database]:
    """One seeded schema for the module: planning never changes the data."""
    db = isolated_schema("tq_plans")
    try:
        _seed(db)
        yield db
    finally:
        drop_schema(db)


def _plan(db: Database, statement: LiteralString, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of the EXPLAIN plan, flattened."""
    with db.connect() as conn:
        row = conn.execute(pgsql.SQL("EXPLAIN (FORMAT JSON) ") + pgsql.SQL(statement), params).fetchone()
    assert row is not None
    doc = row["QUERY PLAN"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    return _flatten(doc[0]["Plan"])


def _flatten(node: dict[str, Any]) -> list[dict[str, Any]]:
    """A plan node and every node below it."""
    nodes = [node]
    for child in node.get("Plans", []):
        nodes += _flatten(child)
    return nodes


def _first_columns(db: Database) -> dict[str, str]:
    """Each index on jobs -> its first column."""
    with db.connect() as conn:
        rows = conn.execute("""
            SELECT c.relname AS index, a.attname AS first
            FROM pg_index i
            JOIN pg_class c ON c.oid = i.indexrelid
            JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
            WHERE i.indrelid = 'jobs'::regclass
        """).fetchall()
    return {str(r["index"]): str(r["first"]) for r in rows}


def _jobs_reads(nodes: list[dict[str, Any]], indexes: set[str]) -> tuple[list[str], list[str]]:
    """(node types that read the jobs table, the jobs indexes the plan uses).
    A Bitmap Index Scan names its index but no relation."""
    types = [n["Node Type"] for n in nodes if n.get("Relation Name") == "jobs"]
    used = [n["Index Name"] for n in nodes if n.get("Index Name") in indexes]
    return types, used


def _params(**filters: Any) -> dict[str, Any]:
    params = search.job_filter(**filters).params()
    return {**params, "limit": 51, "before_id": None, "before_at": None}


def _bulk_params(**filters: Any) -> dict[str, Any]:
    return {**_params(**filters), "max_id": JOBS, "chunk": search.CHUNK, "at": None, "channel": "tq_test"}


TENANT_SHAPES: dict[str, dict[str, Any]] = {
    "tenant": {},
    "kind": {"kind": "kind.3"},
    "pending": {"status": "pending"},
    "dead": {"status": "dead"},
    "done": {"status": "done"},
    "cancelled": {"status": "cancelled"},
    "running": {"status": "running"},
    "actor": {"actor": "user-3"},
    "meta": {"meta": {"plan": "pro"}},
    "since": {"since": "1d"},
    "everything": {"kind": "kind.3", "status": "done", "actor": "user-3", "meta": {"plan": "pro"},
                   "since": "7d"},
}


def _cte(nodes: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The nodes of the plan of CTE `name`."""
    for node in nodes:
        if node.get("Subplan Name") == f"CTE {name}":
            return _flatten(node)
    raise AssertionError(f"no CTE {name} in the plan: {nodes}")


def _assert_tenant_led(db: Database, nodes: list[dict[str, Any]], *,
                       selection: str | None = None) -> list[str]:
    """No Seq Scan on jobs anywhere; the jobs are selected (in CTE
    `selection`, or by the whole plan) off indexes led by tenant_id only.
    Outside the selection, the UPDATE finds the selected ids by jobs_pkey."""
    firsts = _first_columns(db)
    types, used = _jobs_reads(nodes, set(firsts))
    assert types, nodes
    assert "Seq Scan" not in types, types
    chosen = used if selection is None else _jobs_reads(_cte(nodes, selection), set(firsts))[1]
    assert chosen, nodes
    assert all(firsts[index] == "tenant_id" for index in chosen), chosen
    assert all(firsts[index] == "tenant_id" or index == "jobs_pkey" for index in used), used
    return chosen


@pytest.mark.parametrize("shape", list(TENANT_SHAPES))
def test_a_tenants_page_reads_a_tenant_led_index(seeded: Database, shape: str) -> None:
    nodes = _plan(seeded, search.statement("find_in_tenant"), _params(tenant="t7", **TENANT_SHAPES[shape]))
    used = _assert_tenant_led(seeded, nodes)
    if shape == "tenant":
        # newest first straight off jobs_by_tenant, walked backwards: no sort
        assert used == ["jobs_by_tenant"], used
        assert any(n["Node Type"] == "Index Scan" and n.get("Scan Direction") == "Backward"
                   for n in nodes), nodes
        assert not any(n["Node Type"] == "Sort" for n in nodes), nodes
    if shape == "since":
        by_tenant = next(n for n in nodes if n.get("Index Name") == "jobs_by_tenant")
        assert "created_at >=" in by_tenant["Index Cond"], by_tenant


def test_a_deeper_page_starts_in_the_index(seeded: Database) -> None:
    """The keyset cursor is an index condition: page 100 reads one page of rows."""
    params = {**_params(tenant="t7"), "before_at": datetime(2020, 1, 1, tzinfo=UTC), "before_id": 1234}
    nodes = _plan(seeded, search.statement("find_in_tenant"), params)
    assert _assert_tenant_led(seeded, nodes) == ["jobs_by_tenant"]
    scan = next(n for n in nodes if n.get("Index Name") == "jobs_by_tenant")
    assert "ROW(created_at, id) <" in scan["Index Cond"], scan
    assert not any(n["Node Type"] == "Sort" for n in nodes), nodes


@pytest.mark.parametrize("block", ["actionable_counts", "cancel_chunk", "retry_dead_chunk"])
@pytest.mark.parametrize("shape", ["tenant", "kind", "actor", "meta", "since"])
def test_counts_and_bulk_actions_read_a_tenant_led_index(seeded: Database, block: str, shape: str) -> None:
    nodes = _plan(seeded, search.statement(block), _bulk_params(tenant="t7", **TENANT_SHAPES[shape]))
    _assert_tenant_led(seeded, nodes, selection=None if block == "actionable_counts" else "target")


def test_without_a_tenant_a_page_reads_the_primary_key_backwards(seeded: Database) -> None:
    """No index leads with created_at: every tenant's newest jobs are read
    off jobs_pkey (ids are assigned in insert order), one page and stop."""
    for params in (_params(), {**_params(), "before_id": 15_000}, _params(kind="kind.3")):
        nodes = _plan(seeded, search.statement("find_all"), params)
        scans = [(n["Node Type"], n.get("Index Name"), n.get("Scan Direction"))
                 for n in nodes if n.get("Relation Name") == "jobs"]
        assert scans == [("Index Scan", "jobs_pkey", "Backward")], scans
        assert not any(n["Node Type"] == "Sort" for n in nodes), nodes


def test_the_meta_filter_is_a_containment_test(seeded: Database) -> None:
    nodes = _plan(seeded, search.statement("find_in_tenant"),
                  _params(tenant="t7", meta={"plan": "pro"}))
    assert any("meta @>" in n.get("Filter", "") for n in nodes), nodes


@pytest.mark.parametrize(("block", "indexes"), [("actionable_counts", {"jobs_runnable", "jobs_dead"}),
                                                ("cancel_chunk", {"jobs_runnable"}),
                                                ("retry_dead_chunk", {"jobs_dead"})])
@pytest.mark.parametrize("shape", ["everyone", "kind"])
def test_without_a_tenant_counts_and_bulk_actions_read_the_status_indexes(
    seeded: Database, block: str, indexes: set[str], shape: str
) -> None:
    """Pending and dead jobs are counted and selected off the partial
    indexes that hold only them: the done jobs (most of the table) are not read."""
    filters = {"kind": "kind.3"} if shape == "kind" else {}
    nodes = _plan(seeded, search.statement(block), _bulk_params(**filters))
    types, used = _jobs_reads(nodes, set(_first_columns(seeded)))
    assert "Seq Scan" not in types, types
    selection = nodes if block == "actionable_counts" else _cte(nodes, "target")
    assert set(_jobs_reads(selection, set(_first_columns(seeded)))[1]) == indexes, used
