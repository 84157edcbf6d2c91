"""The queue's gauges, read from Postgres when scraped, and the endpoints
that serve them with the process's instruments (observe/metrics.py): the
worker's `--metrics-port` and the dashboard's /metrics. Apart from
metrics.py so that what records metrics (the egress proxy of a Sandbox API
sandbox among them) never loads the store or psycopg."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, make_asgi_app, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tenantq.observe.metrics import REGISTRY, Forward
from tenantq.store.db import Database
from tenantq.store.queries import sql


class QueueCollector(Collector):
    """Queue gauges, read from Postgres when scraped."""

    def __init__(self, db: Database, *, top_tenants: int = 20) -> None:
        self.db = db
        self.top_tenants = top_tenants

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pending = GaugeMetricFamily("tenantq_pending_jobs", "Pending jobs.", labels=["tenant", "priority"])
        oldest = GaugeMetricFamily("tenantq_oldest_pending_seconds", "Age of the oldest pending job.",
                                   labels=["tenant", "priority"])
        running = GaugeMetricFamily("tenantq_running_jobs", "Jobs running now.",
                                    labels=["tenant", "priority"])
        dead = GaugeMetricFamily("tenantq_dead_jobs", "Jobs in the dead-letter list.",
                                 labels=["tenant", "priority"])
        batches = GaugeMetricFamily("tenantq_running_batches", "Live leases (running batches).",
                                    labels=["tenant"])
        with self.db.connect() as conn:
            rows: list[dict[str, Any]] = conn.execute(sql("jobs", "status_counts"),
                                                      {"tenant_id": None}).fetchall()
            live: list[dict[str, Any]] = conn.execute(sql("batches", "live")).fetchall()
        top = _top_tenants(rows, self.top_tenants)
        merged: dict[tuple[str, str], dict[str, float]] = {}
        for r in rows:
            key = (r["tenant_id"] if r["tenant_id"] in top else "other", r["priority"])
            m = merged.setdefault(key, {"pending": 0, "running": 0, "dead": 0, "oldest": 0.0})
            m["pending"] += int(r["pending"])
            m["running"] += int(r["running"])
            m["dead"] += int(r["dead"])
            m["oldest"] = max(m["oldest"], float(r["oldest_pending_seconds"] or 0.0))
        for (tenant, priority), m in sorted(merged.items()):
            pending.add_metric([tenant, priority], m["pending"])
            oldest.add_metric([tenant, priority], m["oldest"])
            running.add_metric([tenant, priority], m["running"])
            dead.add_metric([tenant, priority], m["dead"])
        per_tenant: dict[str, int] = {}
        for b in live:
            label = b["tenant_id"] if b["tenant_id"] in top else "other"
            per_tenant[label] = per_tenant.get(label, 0) + 1
        for tenant, n in sorted(per_tenant.items()):
            batches.add_metric([tenant], n)
        yield from (pending, oldest, running, dead, batches)


def _top_tenants(rows: list[dict[str, Any]], n: int) -> set[str]:
    totals: dict[str, int] = {}
    for r in rows:
        totals[r["tenant_id"]] = totals.get(r["tenant_id"], 0) + int(r["pending"]) + int(r["running"])
    return set(sorted(totals, key=lambda t: (-totals[t], t))[:n])


def registry_for(db: Database, *, top_tenants: int = 20) -> CollectorRegistry:
    """The process's instruments plus the queue gauges of `db`."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(QueueCollector(db, top_tenants=top_tenants))
    registry.register(Forward(REGISTRY))
    return registry


def asgi_app(db: Database, *, top_tenants: int = 20) -> Any:
    return make_asgi_app(registry=registry_for(db, top_tenants=top_tenants))


def serve_worker_metrics(db: Database, port: int, *, host: str = "127.0.0.1", top_tenants: int = 20) -> None:
    """`tenantq worker --metrics-port P`: a /metrics endpoint in a thread."""
    start_http_server(port, addr=host, registry=registry_for(db, top_tenants=top_tenants))
