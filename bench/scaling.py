"""Pick-and-claim cost versus backlog size and tenant count.

Each measurement runs `claim_next` (the DRR pick plus the claim of one
batch) inside a transaction that is rolled back, so every iteration sees the
same seeded state. The cost must stay flat from 1k to 1M pending jobs and
from 10 to 10,000 tenants (idle or active).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import machine_info, save, scratch_schema
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.store.db import Database

console = Console(width=150)

SEED = """
INSERT INTO tenants (tenant_id)
    SELECT 't' || g FROM generate_series(1, %(active)s) g
    UNION ALL SELECT 'idle' || g FROM generate_series(1, %(idle)s) g;
INSERT INTO queues (tenant_id, priority, has_work)
    SELECT 't' || g, 'default', true FROM generate_series(1, %(active)s) g
    UNION ALL SELECT 'idle' || g, 'default', false FROM generate_series(1, %(idle)s) g;
INSERT INTO jobs (tenant_id, kind, payload, priority, run_after, created_at)
    SELECT 't' || (g %% %(active)s + 1), 'bench.noop', '{}'::jsonb, 'default', now(), now()
    FROM generate_series(1, %(pending)s) g;
ANALYZE;
"""


def measure(db: Database, *, picks: int) -> list[float]:
    request = ClaimRequest(worker_id="bench", driver="inline", batch_size=10, lease_seconds=30)
    samples: list[float] = []
    with db.connect() as conn:
        for _ in range(picks):
            with conn.transaction(force_rollback=True):
                t0 = time.perf_counter()
                batch = claim_next(conn, request, "default")
                samples.append(time.perf_counter() - t0)
                assert batch is not None and len(batch.jobs) == 10
    return samples


CASES: list[tuple[str, dict[str, int]]] = [
    ("1k pending, 10 tenants", {"pending": 1_000, "active": 10, "idle": 0}),
    ("100k pending, 10 tenants", {"pending": 100_000, "active": 10, "idle": 0}),
    ("1M pending, 10 tenants", {"pending": 1_000_000, "active": 10, "idle": 0}),
    ("1k pending, 10 tenants + 10,000 idle", {"pending": 1_000, "active": 10, "idle": 10_000}),
    ("100k pending, 10,000 active tenants", {"pending": 100_000, "active": 10_000, "idle": 0}),
]


def run(*, picks: int = 300, max_pending: int = 1_000_000) -> dict[str, Any]:
    results: dict[str, dict[str, float]] = {}
    info: dict[str, Any] = {}
    for label, sizes in CASES:
        if sizes["pending"] > max_pending:
            continue
        with scratch_schema("scale") as db:
            info = info or machine_info(db)
            t0 = time.perf_counter()
            with db.connect() as conn:
                for statement in SEED.split(";"):
                    if statement.strip():
                        conn.execute(statement, sizes)  # type: ignore[arg-type]
            seeded = time.perf_counter() - t0
            samples = measure(db, picks=picks)
        ms = sorted(s * 1000 for s in samples)
        results[label] = {"p50_ms": statistics.median(ms), "p99_ms": ms[int(len(ms) * 0.99) - 1],
                          "seed_seconds": seeded, **sizes}
    base = next(iter(results.values()))["p50_ms"]
    table = Table(title=f"pick + claim of one 10-job batch, {picks} picks each (rolled back)")
    for col in ("case", "p50 ms", "p99 ms", "p50 vs first"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for label, r in results.items():
        table.add_row(label, f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['p50_ms'] / base:.2f}x")
    console.print(table)
    payload = {"benchmark": "scaling", "machine": info, "settings": {"picks": picks, "batch_size": 10},
               "results": results}
    console.print(f"wrote {save('scaling', payload)}")
    return payload
