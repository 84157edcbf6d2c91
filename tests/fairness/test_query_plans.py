"""Query-plan regression tests (after pgqueuer): on seeded data the claim
path must use its indexes, so a pick costs the same with 10 or 100,000
pending jobs and with 10 or 10,000 idle tenants."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tenantq.store.db import Database
from tenantq.store.queries import sql


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


def _plan(db: Database, statement: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of the EXPLAIN plan, flattened."""
    with db.connect() as conn:
        row = conn.execute("EXPLAIN (FORMAT JSON) " + statement, params).fetchone()  # type: ignore[operator]
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


@pytest.fixture
def seeded(db: Database) -> Database:
    _seed(db)
    return db


def test_claim_uses_the_runnable_index(seeded: Database) -> None:
    nodes = _plan(seeded, sql("jobs", "claim"), {
        "tenant_id": "small", "priority": "bulk", "limit": 10, "worker_id": "w", "driver": "inline",
        "lease_seconds": 30.0, "now": None,
    })
    scans = _scans(nodes, "jobs")
    assert scans, nodes
    assert all(kind != "Seq Scan" for kind, _ in scans), scans
    assert any(index == "jobs_runnable" for _, index in scans), scans


def test_candidates_read_only_queues_with_work(seeded: Database) -> None:
    nodes = _plan(seeded, sql("queues", "candidates"), {
        "priority": "bulk", "from_tenant": "", "limit": 32, "now": None,
    })
    scans = _scans(nodes, "queues")
    assert len(scans) == 2, scans  # one per side of the cursor
    assert all(index == "queues_with_work" for _, index in scans), scans
    assert all(kind != "Seq Scan" for kind, _ in _scans(nodes, "tenants")), nodes


def test_settle_and_expire_use_lease_indexes(seeded: Database) -> None:
    settle = _scans(_plan(seeded, sql("jobs", "settle"), {
        "batch_id": 1, "ids": [1, 2], "statuses": ["done", "done"], "results": [None, None],
        "errors": [None, None], "delays": [0.0, 0.0], "now": None,
    }), "jobs")
    assert all(kind != "Seq Scan" for kind, _ in settle), settle
    expire = _plan(seeded, sql("batches", "expire"), {"now": None})
    assert all(kind != "Seq Scan" for kind, _ in _scans(expire, "jobs")), _scans(expire, "jobs")
