"""Query-plan regression tests (after pgqueuer): on seeded data the claim
path must use its indexes, so a pick costs the same with 10 or 100,000
pending jobs and with 10 or 10,000 idle tenants; with a worker's kinds the
claim stays on jobs_runnable, and the attempt history is read off its
indexes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql
from psycopg.sql import Composed

from tenantq.store.db import Database
from tenantq.store.migrate import migrate
from tenantq.store.queries import composed, sql


def _seed(db: Database) -> None:
    with db.connect() as conn:
        conn.execute("""
            INSERT INTO tenants (tenant_id) SELECT 'idle' || g FROM generate_series(1, 5000) g;
            INSERT INTO tenants (tenant_id) VALUES ('whale'), ('small');
            INSERT INTO queues (tenant_id, priority, has_work)
                SELECT 'idle' || g, p, false
                FROM generate_series(1, 5000) g, unnest(ARRAY['interactive', 'default', 'bulk']) p;
            INSERT INTO queues (tenant_id, priority) VALUES ('whale', 'bulk'), ('small', 'bulk');
            INSERT INTO jobs (tenant_id, kind, payload, priority, run_after, created_at, status, finished_at)
                SELECT CASE WHEN g % 1000 = 0 THEN 'small' ELSE 'whale' END, 'k', '{}'::jsonb, 'bulk',
                       now(), now(), CASE WHEN g % 3 = 0 THEN 'done' ELSE 'pending' END,
                       CASE WHEN g % 3 = 0 THEN now() END
                FROM generate_series(1, 100000) g;
            INSERT INTO jobs (tenant_id, kind, payload, priority, run_after, created_at, status, finished_at)
                SELECT 'idle' || (g % 5000 + 1), 'k', '{}'::jsonb, 'default', now(), now(), 'done', now()
                FROM generate_series(1, 50000) g;
            ANALYZE;
        """)


def _plan(db: Database, statement: str | Composed, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of the EXPLAIN plan, flattened."""
    with db.connect() as conn:
        text = statement if isinstance(statement, str) else statement.as_string(None)
        row = conn.execute("EXPLAIN (FORMAT JSON) " + text, params).fetchone()  # type: ignore[operator]
    assert row is not None
    doc = row["QUERY PLAN"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    nodes: list[dict[str, Any]] = []

    def walk(node: dict[str, Any]) -> None:
        nodes.append(node)
        for child in node.get("Plans", []):
            walk(child)

    walk(doc[0]["Plan"])
    return nodes


def _scans(nodes: list[dict[str, Any]], relation: str) -> list[tuple[str, str | None]]:
    return [(n["Node Type"], n.get("Index Name")) for n in nodes if n.get("Relation Name") == relation]


@pytest.fixture(scope="module")
def seeded(server_dsn: str) -> Iterator[Database]:
    """One seeded schema for the module (about 3 s to seed): every test only
    EXPLAINs, none writes."""
    db = Database(dsn=server_dsn, schema=f"tq_plans_{uuid.uuid4().hex[:10]}")
    try:
        migrate(db)
        _seed(db)
        _seed_attempts(db)
        yield db
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(db.schema)))


@pytest.mark.parametrize("kinds", [None, ["k"], ["other.kind", "k", "a.third"]])
def test_claim_uses_the_runnable_index(seeded: Database, kinds: list[str] | None) -> None:
    nodes = _plan(seeded, composed("jobs", "claim", lease="lease"), {
        "tenant_id": "small", "priority": "bulk", "limit": 10, "worker_id": "w", "driver": "inline",
        "lease_seconds": 30.0, "kinds": kinds, "now": None,
    })
    scans = _scans(nodes, "jobs")
    assert scans, nodes
    assert all(kind != "Seq Scan" for kind, _ in scans), scans
    assert any(index == "jobs_runnable" for _, index in scans), scans
    if kinds is not None:
        # the kinds are a filter on the rows of that same index scan
        runnable = [n for n in nodes if n.get("Index Name") == "jobs_runnable"]
        assert any("kind = ANY" in n.get("Filter", "") for n in runnable), runnable


@pytest.mark.parametrize("kinds", [None, ["k"]])
def test_candidates_read_only_queues_with_work(seeded: Database, kinds: list[str] | None) -> None:
    nodes = _plan(seeded, composed("queues", "candidates", rate_columns="rate_columns"), {
        "priority": "bulk", "from_tenant": "", "limit": 32, "kinds": kinds, "now": None,
    })
    scans = _scans(nodes, "queues")
    assert len(scans) == 2, scans  # one per side of the cursor
    assert all(index == "queues_with_work" for _, index in scans), scans
    assert all(kind != "Seq Scan" for kind, _ in _scans(nodes, "tenants")), nodes


def test_clear_if_empty_reads_the_runnable_index(seeded: Database) -> None:
    """The kinds hint is re-derived from jobs_runnable (min() twice, the
    runnable rows' kinds once), never from a scan of the table."""
    nodes = _plan(seeded, sql("queues", "clear_if_empty"),
                  {"tenant_id": "small", "priority": "bulk", "now": None})
    scans = _scans(nodes, "jobs")
    assert len(scans) == 3, scans
    assert all(kind != "Seq Scan" for kind, _ in scans), scans
    # a bitmap index scan names no relation; the queue row is read by its key
    indexes = {n["Index Name"] for n in nodes
               if "Index Name" in n and n.get("Relation Name", "jobs") == "jobs"}
    assert indexes == {"jobs_runnable"}, indexes


def _seed_attempts(db: Database) -> None:
    with db.connect() as conn:
        conn.execute("""
            INSERT INTO attempts (tenant_id, job_id, attempt, started_at, finished_at, worker_id, driver,
                                  outcome, error)
                SELECT CASE WHEN g % 100 = 0 THEN 'small' ELSE 'whale' END, g, 1,
                       now() - make_interval(secs => g), now() - make_interval(secs => g), 'w', 'inline',
                       CASE WHEN g % 10 = 0 THEN 'failed' ELSE 'done' END,
                       CASE WHEN g % 10 = 0 THEN 'boom' END
                FROM generate_series(1, 100000) g;
            ANALYZE attempts;
        """)


@pytest.mark.parametrize(("tenant", "index"), [(None, "attempts_failures"),
                                               ("small", "attempts_failures_by_tenant")])
def test_recent_failures_read_a_failures_index(seeded: Database, tenant: str | None, index: str) -> None:
    nodes = _plan(seeded, sql("web", "recent_failures"), {"tenant_id": tenant, "limit": 20})
    scans = _scans(nodes, "attempts")
    assert scans == [("Index Scan", index)], scans  # newest first, straight off the index
    assert not any(n["Node Type"] == "Sort" for n in nodes), nodes


def test_a_jobs_attempt_history_reads_the_primary_key(seeded: Database) -> None:
    nodes = _plan(seeded, sql("jobs", "attempts_of"), {"tenant_id": "small", "id": 100, "limit": 100})
    assert all(kind != "Seq Scan" for kind, _ in _scans(nodes, "attempts")), nodes
    assert any(n.get("Index Name") == "attempts_pkey" for n in nodes), nodes


def test_settle_and_expire_use_lease_indexes(seeded: Database) -> None:
    settle = _scans(_plan(seeded, sql("jobs", "settle"), {
        "batch_id": 1, "ids": [1, 2], "statuses": ["done", "done"], "results": [None, None],
        "errors": [None, None], "delays": [0.0, 0.0], "host_calls": [None, None], "now": None,
    }), "jobs")
    assert all(kind != "Seq Scan" for kind, _ in settle), settle
    expire = _plan(seeded, sql("batches", "expire"), {"now": None})
    assert all(kind != "Seq Scan" for kind, _ in _scans(expire, "jobs")), _scans(expire, "jobs")
    release = _scans(_plan(seeded, sql("jobs", "release_unstarted"),
                           {"batch_id": 1, "ids": [1, 2], "now": None}), "jobs")
    assert all(kind != "Seq Scan" for kind, _ in release), release
