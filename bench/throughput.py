"""Enqueue (single and bulk) and inline drain throughput of no-op jobs,
tenantq beside its peers, each at its best setting on this machine.

The best setting is searched, not assumed: each system's drain is run once
at every point of a small grid (worker processes x batch size x
concurrency) on the same server, the grid is reported, and the best point
is then run `repeats` times for the table, the systems taking turns (one
run of each per round). Every row names its setting.
Worker processes are started and connected before the clock starts and
start together (tenantq: `_drain`; the peers: peerlib's `Helpers`).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import subprocess
import time
from typing import Any

from rich.console import Console
from rich.table import Table

import tenantq
from bench.common import machine_info, save, scratch_schema, spawned, summarise
from bench.peers.peerlib import server_cpu_meter
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.registry import Registry
from tenantq.store.db import Database

console = Console(width=150)
REGISTRY = Registry()
# (processes, concurrency per process, batch size)
TENANTQ_GRID = [(p, c, b) for p in (1, 2) for c in (2, 3) for b in (500, 1000)]
# per peer: the adapter's flags at each point; Procrastinate has no batch size
PEER_GRIDS: dict[str, list[dict[str, int | None]]] = {
    "pgqueuer": [{"processes": p, "batch_size": b, "concurrency": None}
                 for p, b in itertools.product((1, 2), (100, 500, 1000))],
    "procrastinate": [{"processes": p, "batch_size": None, "concurrency": c}
                      for p, c in itertools.product((1, 2), (8, 32))],
}
# the table's figures (jobs/s)
COLUMNS = {"enqueue_single": "enqueue, one call per job", "enqueue_many": "enqueue_many / bulk of {jobs:,}",
           "enqueue_big": "enqueue_many / bulk of {big:,}", "drain_inline": "drain"}
CPU_COLUMNS = ("drain_cpu_client_us", "drain_cpu_server_us")
# Procrastinate drains about 400 jobs/s here: its grid runs on fewer jobs
GRID_JOBS = {"tenantq": 20_000, "pgqueuer": 20_000, "procrastinate": 4_000}


@tenantq.handler("bench.noop", isolation="inline", registry=REGISTRY)
def _noop(payload: Any, ctx: tenantq.JobContext) -> None:
    return None


def _job(seq: int, tenants: int) -> JobSpec:
    """The payload every peer's jobs carry too (bench/peers/peerlib.py, JobPayload)."""
    tenant = f"t{seq % tenants}"
    return JobSpec(tenant, "bench.noop", {"tenant": tenant, "seq": seq})


def _drain_process(dsn: str, schema: str, concurrency: int, batch_size: int, go: Any, out: Any,
                   ready: Any) -> None:
    worker = Worker(Database(dsn=dsn, schema=schema), InlineExecutor(REGISTRY),
                    WorkerConfig(concurrency=concurrency, batch_size=batch_size, once=True))
    ready.set()
    go.wait()
    cpu0 = time.process_time()
    done = worker.run().done
    out.put((done, time.process_time() - cpu0))


def _drain(db: Database, *, processes: int, concurrency: int,
           batch_size: int) -> tuple[float, int, dict[str, float | None]]:
    """Seconds for `processes` worker processes (`--once`, fair scheduling
    on) to drain the schema, timed from their common start; jobs done; and
    the CPU seconds the workers and the server used meanwhile (the server's
    measured as the peers' is: peerlib.server_cpu_meter)."""
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    args = (db.dsn, db.schema, concurrency, batch_size, go, out)
    server_cpu = server_cpu_meter(db.dsn)
    with spawned(ctx, _drain_process, args, processes) as procs:
        server0 = server_cpu() if server_cpu else 0.0
        t0 = time.perf_counter()
        go.set()
        ended = [out.get(timeout=600) for _ in procs]
        elapsed = time.perf_counter() - t0
        server = server_cpu() - server0 if server_cpu else None
        for proc in procs:
            proc.join(60)
    return elapsed, sum(e[0] for e in ended), {"client": sum(e[1] for e in ended), "server": server}


def _tenantq_run(*, jobs: int, tenants: int, single: int, processes: int, concurrency: int,
                 batch_size: int, big: int = 0) -> dict[str, float | None]:
    with scratch_schema() as db:
        q = Queue(db.dsn, schema=db.schema)
        t0 = time.perf_counter()
        for i in range(single):
            q.enqueue(f"t{i % tenants}", "bench.noop", {"tenant": f"t{i % tenants}", "seq": i})
        single_s = time.perf_counter() - t0
        specs = [_job(i, tenants) for i in range(single, single + jobs)]
        t0 = time.perf_counter()
        q.enqueue_many(specs)
        many_s = time.perf_counter() - t0
        elapsed, done, cpu = _drain(db, processes=processes, concurrency=concurrency, batch_size=batch_size)
        assert done == jobs + single, f"drained {done} of {jobs + single}"
        big_s = 0.0
        if big:  # one call of a large import, after the drain (not drained)
            specs = [_job(i, tenants) for i in range(big)]
            t0 = time.perf_counter()
            q.enqueue_many(specs)
            big_s = time.perf_counter() - t0
        q.close()
    return {"enqueue_single": single / single_s if single else 0.0, "enqueue_many": jobs / many_s,
            "drain_inline": (jobs + single) / elapsed, "enqueue_big": big / big_s if big else 0.0,
            **_cpu_us(cpu, jobs + single)}


def _cpu_us(cpu: dict[str, float | None], jobs: int) -> dict[str, float | None]:
    """CPU per drained job in µs (None: the server's could not be read)."""
    return {f"drain_cpu_{side}_us": None if used is None else used / jobs * 1e6 for side, used in cpu.items()}


def peer_throughput(system: str, *, jobs: int, single: int, setting: dict[str, int | None],
                    big: int = 0) -> dict[str, Any] | None:
    """One run of a peer's throughput scenario (its own venv, same server)."""
    from bench.fairness import PEERS_DIR

    script = PEERS_DIR / f"{system}_bench.py"
    python = PEERS_DIR / ".venv" / "bin" / "python"
    if not script.exists():
        return None
    if not python.exists():
        subprocess.run(["python3", str(PEERS_DIR / "setup.py")], check=True, stdout=subprocess.DEVNULL)
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in setting.items() if value is not None]
    dsn = Database.resolve().dsn
    out = subprocess.run([str(python), str(script), "throughput", "--dsn", dsn, "--jobs", str(jobs),
                          "--single", str(single), "--big-bulk", str(big), *flags],
                         check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _label(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {'default' if v is None else v}" for k, v in setting.items())


def run(*, jobs: int = 20_000, tenants: int = 10, single: int = 1_000, repeats: int = 5,
        peers: bool = True, grid: bool = True, big: int = 200_000) -> dict[str, Any]:
    """`big`: one enqueue_many (bulk) call of that many jobs after each
    table run's drain (a large import; its jobs are not drained)."""
    with scratch_schema() as db:
        info = machine_info(db)
    searched: dict[str, list[dict[str, Any]]] = {"tenantq": []}
    points = TENANTQ_GRID if grid else TENANTQ_GRID[:1]
    for p, c, b in points:
        rate = _tenantq_run(jobs=GRID_JOBS["tenantq"] if grid else jobs, tenants=tenants, single=0,
                            processes=p, concurrency=c, batch_size=b)["drain_inline"]
        searched["tenantq"].append({"setting": {"processes": p, "concurrency": c, "batch_size": b},
                                    "drain_per_s": rate})
    for system, peer_points in PEER_GRIDS.items() if peers else ():
        searched[system] = []
        for setting in peer_points if grid else peer_points[:1]:
            r = peer_throughput(system, jobs=GRID_JOBS[system], single=0, setting=setting)
            if r is not None:
                searched[system].append({"setting": setting, "drain_per_s": r["drain_per_s"]})
    _grid_table(searched)

    # the table: each system at its best point, and tenantq's best with one process and with two
    best: dict[str, dict[str, Any]] = {}
    for system, rows in searched.items():
        if rows and system != "tenantq":
            best[system] = max(rows, key=lambda r: r["drain_per_s"])["setting"]
    for procs in (1, 2):
        rows = [r for r in searched["tenantq"] if r["setting"]["processes"] == procs]
        if rows:
            best[f"tenantq, {procs} process{'es' if procs > 1 else ''}"] = \
                max(rows, key=lambda r: r["drain_per_s"])["setting"]
    # Interleaved: each round runs every system once, so that a change in
    # the machine's speed during the run (seen here: 15% within minutes)
    # falls on every system alike instead of on whichever ran then.
    order = sorted(best, key=lambda name: not name.startswith("tenantq"))
    samples: dict[str, dict[str, list[float | None]]] = {
        name: {key: [] for key in (*COLUMNS, *CPU_COLUMNS)} for name in order}
    for _ in range(repeats):
        for name in order:
            setting = best[name]
            if name.startswith("tenantq"):
                r = _tenantq_run(jobs=jobs, tenants=tenants, single=single, big=big, **setting)
            else:
                peer = peer_throughput(name, jobs=jobs, single=single, setting=setting, big=big)
                assert peer is not None
                used = peer["drain_cpu_us"]
                r = {"enqueue_single": peer["enqueue_single_per_s"],
                     "enqueue_many": peer["enqueue_bulk_per_s"],
                     "enqueue_big": peer["enqueue_big_bulk_per_s"] or 0.0,
                     "drain_inline": peer["drain_per_s"],
                     "drain_cpu_client_us": used["client"], "drain_cpu_server_us": used["server"]}
            for key in samples[name]:
                samples[name][key].append(r[key])
    results: dict[str, dict[str, Any]] = {
        name: {"setting": best[name],
               **{k: summarise([x for x in v if x is not None]) if None not in v else None
                  for k, v in samples[name].items()}}
        for name in order}
    _main_table(results, jobs=jobs, single=single, repeats=repeats, big=big)
    _cpu_table(results, repeats=repeats)
    payload = {"benchmark": "throughput", "machine": info,
               "settings": {"jobs": jobs, "tenants": tenants, "single": single, "repeats": repeats,
                            "big": big, "grid_jobs": GRID_JOBS},
               "grid": searched, "results": results}
    console.print(f"wrote {save('throughput', payload)}")
    return payload


def _grid_table(searched: dict[str, list[dict[str, Any]]]) -> None:
    table = Table(title="drain, one run per setting (the search for each system's best setting)")
    table.add_column("system")
    table.add_column("setting")
    table.add_column("jobs/s", justify="right")
    for system, rows in searched.items():
        for r in sorted(rows, key=lambda r: -r["drain_per_s"]):
            table.add_row(system, _label(r["setting"]), f"{r['drain_per_s']:,.0f}")
    console.print(table)


def _cpu_table(results: dict[str, dict[str, Any]], *, repeats: int) -> None:
    table = Table(title=f"CPU per drained job, µs (median of {repeats}): the worker processes' own, "
                        "the Postgres server's (all its processes)")
    for label in ("system (setting)", "workers", "server", "both"):
        table.add_column(label, justify="left" if label.startswith("system") else "right")
    for name, r in results.items():
        client, server = r["drain_cpu_client_us"]["median"], r["drain_cpu_server_us"]
        table.add_row(f"{name} ({_label(r['setting'])})", f"{client:.1f}",
                      *(("-", "-") if server is None else (f"{server['median']:.1f}",
                                                            f"{client + server['median']:.1f}")))
    console.print(table)


def _main_table(results: dict[str, dict[str, Any]], *, jobs: int, single: int, repeats: int,
                big: int) -> None:
    table = Table(title=f"throughput: {jobs:,} no-op jobs (+{single:,} enqueued one call each), each system "
                        f"at its best setting, median of {repeats} (min-max); tenantq fair scheduling on")
    table.add_column("system (setting)")
    for label in COLUMNS.values():
        table.add_column(label.format(jobs=jobs, big=big), justify="right")
    pgq = results.get("pgqueuer")
    if pgq:
        for key in COLUMNS:
            table.add_column(f"{key.replace('_', ' ')} / PgQueuer", justify="right")
    for name, r in results.items():
        cells = [f"{name} ({_label(r['setting'])})"]
        for key in COLUMNS:
            cells.append(f"{r[key]['median']:,.0f} ({r[key]['min']:,.0f}-{r[key]['max']:,.0f})")
        if pgq:
            cells += [f"{r[key]['median'] / pgq[key]['median']:.2f}x" if pgq[key]["median"] else "-"
                      for key in COLUMNS]
        table.add_row(*cells)
    console.print(table)
