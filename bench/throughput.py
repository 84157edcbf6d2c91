"""Enqueue (single and bulk) and inline drain throughput of no-op jobs."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table

import tenantq
from bench.common import machine_info, save, scratch_schema, summarise
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.registry import Registry

console = Console(width=150)
REGISTRY = Registry()


@tenantq.handler("bench.noop", isolation="inline", registry=REGISTRY)
def _noop(payload: Any, ctx: tenantq.JobContext) -> None:
    return None


def peer_throughput(system: str, *, jobs: int, single: int) -> dict[str, Any] | None:
    """One run of a peer's throughput scenario (its own venv, same server)."""
    import json
    import subprocess

    from bench.fairness import PEERS_DIR

    script = PEERS_DIR / f"{system}_bench.py"
    python = PEERS_DIR / ".venv" / "bin" / "python"
    if not script.exists():
        return None
    if not python.exists():
        subprocess.run(["python3", str(PEERS_DIR / "setup.py")], check=True, stdout=subprocess.DEVNULL)
    from tenantq.store.db import Database

    dsn = Database.resolve().dsn
    out = subprocess.run([str(python), str(script), "throughput", "--dsn", dsn, "--jobs", str(jobs),
                          "--single", str(single)], check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run(*, jobs: int = 20_000, tenants: int = 10, single: int = 1_000, repeats: int = 3,
        concurrency: int = 3, batch_size: int = 500, peers: bool = True) -> dict[str, Any]:
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
    peer_results: dict[str, dict[str, dict[str, float]]] = {}
    for system in ("pgqueuer", "procrastinate") if peers else ():
        runs = [r for _ in range(repeats) if (r := peer_throughput(system, jobs=jobs, single=single))]
        if runs:
            peer_results[system] = {
                "enqueue_single": summarise([r["enqueue_single_per_s"] for r in runs]),
                "enqueue_many": summarise([r["enqueue_bulk_per_s"] for r in runs]),
                "drain_inline": summarise([r["drain_per_s"] for r in runs]),
                "settings": runs[0].get("settings", {}),
            }
    table = Table(title=f"throughput: {jobs:,} no-op jobs over {tenants} tenants, median of {repeats} "
                        "(min-max); tenantq with fair scheduling on; peers with their best settings")
    table.add_column("operation")
    table.add_column("jobs/s", justify="right")
    table.add_column("min-max", justify="right")
    labels = {"enqueue_single": f"enqueue, one call per job ({single:,})",
              "enqueue_many": f"enqueue_many, one call ({jobs:,})",
              "drain_inline": f"drain inline, concurrency {concurrency}, batch {batch_size}"}
    for system in peer_results:
        table.add_column(f"{system} jobs/s", justify="right")
        table.add_column(f"tenantq / {system}", justify="right")
    for name, r in results.items():
        cells = [labels[name], f"{r['median']:,.0f}", f"{r['min']:,.0f}-{r['max']:,.0f}"]
        for peer in peer_results.values():
            other = peer[name]["median"]
            cells += [f"{other:,.0f}", f"{r['median'] / other:.2f}x"]
        table.add_row(*cells)
    console.print(table)
    payload = {"benchmark": "throughput", "machine": info,
               "settings": {"jobs": jobs, "tenants": tenants, "single": single, "repeats": repeats,
                            "concurrency": concurrency, "batch_size": batch_size},
               "results": results, "peers": peer_results}
    console.print(f"wrote {save('throughput', payload)}")
    return payload
