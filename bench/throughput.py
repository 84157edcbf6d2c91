"""Enqueue (single and bulk) and inline drain throughput of no-op jobs."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table

import tenantq
from bench.common import machine_info, save, scratch_schema, summarise
from tenantq import JobSpec, Queue
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.registry import Registry
from tenantq.sandbox.inline import InlineExecutor

console = Console()
REGISTRY = Registry()


@tenantq.handler("bench.noop", isolation="inline", registry=REGISTRY)
def _noop(payload: Any, ctx: tenantq.JobContext) -> None:
    return None


def run(*, jobs: int = 20_000, tenants: int = 10, single: int = 1_000, repeats: int = 3,
        concurrency: int = 2, batch_size: int = 100) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"enqueue_single": [], "enqueue_many": [], "drain_inline": []}
    info: dict[str, Any] = {}
    for _ in range(repeats):
        with scratch_schema() as db:
            info = info or machine_info(db)
            q = Queue(db.dsn, schema=db.schema)
            t0 = time.perf_counter()
            for i in range(single):
                q.enqueue(f"t{i % tenants}", "bench.noop")
            samples["enqueue_single"].append(single / (time.perf_counter() - t0))
            specs = [JobSpec(f"t{i % tenants}", "bench.noop") for i in range(jobs)]
            t0 = time.perf_counter()
            q.enqueue_many(specs)
            samples["enqueue_many"].append(jobs / (time.perf_counter() - t0))
            total = jobs + single
            worker = Worker(db, InlineExecutor(REGISTRY), WorkerConfig(
                concurrency=concurrency, batch_size=batch_size, once=True))
            t0 = time.perf_counter()
            stats = worker.run()
            elapsed = time.perf_counter() - t0
            assert stats.done == total, f"drained {stats.done} of {total}"
            samples["drain_inline"].append(total / elapsed)
            q.close()
    results = {name: summarise(values) for name, values in samples.items()}
    table = Table(title=f"throughput: {jobs:,} no-op jobs over {tenants} tenants, "
                        f"median of {repeats} (min-max)")
    table.add_column("operation")
    table.add_column("jobs/s", justify="right")
    table.add_column("min-max", justify="right")
    labels = {"enqueue_single": f"enqueue, one call per job ({single:,})",
              "enqueue_many": f"enqueue_many, one call ({jobs:,})",
              "drain_inline": f"drain inline, concurrency {concurrency}, batch {batch_size}"}
    for name, r in results.items():
        table.add_row(labels[name], f"{r['median']:,.0f}", f"{r['min']:,.0f}-{r['max']:,.0f}")
    console.print(table)
    payload = {"benchmark": "throughput", "machine": info,
               "settings": {"jobs": jobs, "tenants": tenants, "single": single, "repeats": repeats,
                            "concurrency": concurrency, "batch_size": batch_size},
               "results": results}
    console.print(f"wrote {save('throughput', payload)}")
    return payload
