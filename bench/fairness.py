"""The noisy-neighbour scenario: a whale's backlog and five small tenants
that enqueue later, for tenantq and (side by side, same Postgres server)
PgQueuer and Procrastinate with their default settings. Plus the shares
weights 1:2:3 achieve.

Wait = when the handler started minus just before the enqueue call.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import tenantq
from bench.common import machine_info, save, scratch_schema
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.registry import Registry
from tenantq.store.db import Database

console = Console(width=150)
PEERS_DIR = Path(__file__).resolve().parent / "peers"


class _Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.whale_done = 0
        self.small_waits: dict[str, list[float]] = {}
        self.shares: dict[str, int] = {}


def _registry(rec: _Recorder, handler_ms: float) -> Registry:
    reg = Registry()

    @tenantq.handler("bench.sleep", isolation="inline", registry=reg)
    def sleep(payload: dict[str, Any], ctx: tenantq.JobContext) -> None:
        started = time.time()
        with rec.lock:
            if ctx.tenant == "whale":
                rec.whale_done += 1
            elif "enq" in payload:
                rec.small_waits.setdefault(ctx.tenant, []).append(started - float(payload["enq"]))
            rec.shares[ctx.tenant] = rec.shares.get(ctx.tenant, 0) + 1
        time.sleep(handler_ms / 1000)

    return reg


def tenantq_noisy(*, whale: int, small_tenants: int = 5, small_jobs: int = 10, concurrency: int = 8,
                  handler_ms: float = 5, batch_size: int = 10, warmup_jobs: int = 200,
                  deadline: float = 120) -> dict[str, Any]:
    rec = _Recorder()
    with scratch_schema("fair") as db:
        q = Queue(db.dsn, schema=db.schema)
        for start in range(0, whale, 20_000):
            q.enqueue_many([JobSpec("whale", "bench.sleep", {"i": i})
                            for i in range(start, min(whale, start + 20_000))])
        worker = Worker(db, InlineExecutor(_registry(rec, handler_ms)), WorkerConfig(
            concurrency=concurrency, batch_size=batch_size, poll_seconds=0.05))
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        worker.started.wait(timeout=30)
        t0 = time.monotonic()
        while whale and rec.whale_done < min(warmup_jobs, whale) and time.monotonic() - t0 < deadline:
            time.sleep(0.01)
        for s in range(small_tenants):
            q.enqueue_many([JobSpec(f"small{s}", "bench.sleep", {"enq": time.time()})
                            for _ in range(small_jobs)])
        target = small_tenants * small_jobs
        while sum(map(len, rec.small_waits.values())) < target and time.monotonic() - t0 < deadline:
            time.sleep(0.01)
        whale_meanwhile = rec.whale_done
        worker.stop()
        thread.join()
        q.close()
    return {"system": "tenantq", "version": tenantq.__version__, "whale": whale,
            "small_waits": rec.small_waits, "whale_done": whale_meanwhile,
            "unfinished_small": target - sum(map(len, rec.small_waits.values())),
            "settings": {"batch_size": batch_size, "concurrency": concurrency}}


def weights_shares(
    *, jobs_per_tenant: int = 6000, run_jobs: int = 3000, concurrency: int = 4
) -> dict[str, float]:
    rec = _Recorder()
    weights = {"w1": 1, "w2": 2, "w3": 3}
    with scratch_schema("weights") as db:
        q = Queue(db.dsn, schema=db.schema)
        for tenant, weight in weights.items():
            q.set_tenant(tenant, weight=weight)
        q.enqueue_many([JobSpec(t, "bench.sleep", {}) for t in weights for _ in range(jobs_per_tenant)])
        worker = Worker(db, InlineExecutor(_registry(rec, 0)), WorkerConfig(concurrency=concurrency,
                                                                           batch_size=10))
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        while sum(rec.shares.values()) < run_jobs:
            time.sleep(0.01)
        worker.stop()
        thread.join()
        q.close()
    total = sum(rec.shares.values())
    return {t: rec.shares.get(t, 0) / total for t in weights}


def _peer(system: str, whale: int, args: dict[str, Any], db: Database) -> dict[str, Any] | None:
    python = PEERS_DIR / ".venv" / "bin" / "python"
    script = PEERS_DIR / f"{system}_bench.py"
    if not script.exists():
        return None
    if not python.exists():
        subprocess.run(["python3", str(PEERS_DIR / "setup.py")], check=True, stdout=subprocess.DEVNULL)
    cmd = [str(python), str(script), "fairness", "--dsn", db.dsn, "--whale", str(whale)]
    for key, value in args.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _stats(waits: dict[str, list[float]]) -> tuple[float, float]:
    flat = [w for ws in waits.values() for w in ws]
    if not flat:
        return float("nan"), float("nan")
    return statistics.median(flat), max(flat)


def run(*, whales: tuple[int, ...] = (2_000, 20_000, 200_000), peers: bool = True,
        small_jobs: int = 10, deadline: float = 120, weights_run: int = 3000,
        plot: bool = True) -> dict[str, Any]:
    common = {"small_tenants": 5, "small_jobs": small_jobs, "concurrency": 8, "handler_ms": 5}
    rows: list[dict[str, Any]] = []
    with scratch_schema("info") as db:
        info = machine_info(db)
        for whale in (0, *whales):
            rows.append(tenantq_noisy(whale=whale, deadline=deadline, **common))
            if peers:
                for system in ("pgqueuer", "procrastinate"):
                    result = _peer(system, whale, {**common, "deadline": deadline}, db)
                    if result is not None:
                        rows.append(result)
    baseline = {r["system"]: _stats(r["small_waits"])[1] for r in rows if r["whale"] == 0}
    table = Table(title="noisy neighbour: 5 small tenants x 10 jobs enqueued while a whale's backlog runs "
                        "(concurrency 8, 5 ms handler)")
    for col in ("system", "whale backlog", "small p50 wait", "small max wait", "max vs empty queue",
                "unfinished"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        p50, worst = _stats(r["small_waits"])
        unfinished = int(r.get("unfinished_small", 0))
        if unfinished:  # some small jobs never started before the deadline
            cells = [f"> {deadline:.0f} s", f"> {deadline:.0f} s", "-"]
        else:
            ratio = worst / baseline[r["system"]] if baseline.get(r["system"]) else float("nan")
            cells = [f"{p50 * 1000:,.0f} ms", f"{worst * 1000:,.0f} ms", f"{ratio:.1f}x"]
        table.add_row(r["system"], f"{r['whale']:,}" if r["whale"] else "empty", *cells, str(unfinished))
    console.print(table)
    shares = weights_shares(run_jobs=weights_run)
    share_table = Table(title="weights 1:2:3, share of jobs run while all three have backlog")
    for col in ("tenant", "weight", "expected", "achieved"):
        share_table.add_column(col, justify="right")
    for i, (tenant, share) in enumerate(shares.items(), start=1):
        share_table.add_row(tenant, str(i), f"{i / 6:.1%}", f"{share:.1%}")
    console.print(share_table)
    payload = {"benchmark": "fairness", "machine": info, "settings": {**common, "whales": whales,
               "deadline": deadline}, "runs": rows, "weights_shares": shares}
    console.print(f"wrote {save('fairness', payload)}")
    if plot:
        from bench.plot import plot_fairness

        console.print(f"plotted {plot_fairness(payload)}")
    return payload
