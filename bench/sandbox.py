"""Sandbox cost: per-batch overhead of each driver against the raw floors,
and end-to-end jobs/s of a 10 ms handler at batch sizes 1, 10, 100 versus
the inline path.

Overhead = create a sandbox, run /bin/true in it as the batch path runs its
guest (same bundle, mounts, cgroups and limits; no `timeout` init, since the
guest runner enforces the TTL itself), destroy it: the driver's whole
per-batch cost without the guest's Python start. Floors: `runsc do
/bin/true`, `bwrap` with the same namespaces running /bin/true, and a plain
subprocess.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import tenantq
from bench.common import machine_info, save, scratch_schema
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.executors.sandboxed import SandboxExecutor
from tenantq.dispatch.executors.warm import WarmPolicy
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.registry import REGISTRY
from tenantq.sandbox.driver import SandboxDriver
from tenantq.sandbox.drivers import bwrap_works, runsc_works
from tenantq.sandbox.drivers.gvisor import GVisorDriver
from tenantq.sandbox.drivers.process import ProcessDriver
from tenantq.sandbox.layout import guest_python
from tenantq.sandbox.spec import SandboxSpec

console = Console(width=150)
APP = "bench.sandbox_app"


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def _time(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def driver_overhead(driver: SandboxDriver, n: int) -> dict[str, list[float]]:
    mounts = guest_python().mounts
    create_exec: list[float] = []
    destroy: list[float] = []
    total: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        sbx = driver.create(SandboxSpec(tenant="bench", memory_mb=256, ttl_seconds=60, mounts=mounts))
        # self_limiting, as for a batch: the guest runner enforces the TTL
        # itself instead of running under a `timeout` init
        result = sbx.run(["/bin/true"], timeout=30, self_limiting=True)
        t1 = time.perf_counter()
        sbx.destroy()
        t2 = time.perf_counter()
        assert result.end.ok, result
        create_exec.append(t1 - t0)
        destroy.append(t2 - t1)
        total.append(t2 - t0)
    return {"create_to_first_exec": create_exec, "destroy": destroy, "total": total}


def floors(n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    out["subprocess /bin/true"] = _time(lambda: subprocess.run(["/bin/true"], check=True), n)
    if bwrap_works():
        cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr", "--symlink",
               "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev",
               "--tmpfs", "/tmp", "/usr/bin/true"]
        out["bwrap /bin/true"] = _time(lambda: subprocess.run(cmd, check=True), n)
    if runsc_works():
        with tempfile.TemporaryDirectory() as root:
            cmd = ["runsc", "--root", root, "--platform=ptrace", "--network=none", "do", "/bin/true"]
            out["runsc do /bin/true"] = _time(lambda: subprocess.run(cmd, check=True, capture_output=True), n)
    return out


def end_to_end(executor_name: str, batch_size: int, jobs: int, data_dir: Path) -> float:
    with scratch_schema("sbx") as db:
        q = Queue(db.dsn, schema=db.schema)
        q.enqueue_many([JobSpec(f"t{i % 4}", "bench.sleep10", {}) for i in range(jobs)])
        if executor_name == "inline":
            executor: Any = InlineExecutor(REGISTRY)
        else:
            driver = GVisorDriver(data_dir) if executor_name == "gvisor" else ProcessDriver(data_dir)
            # cold sandboxes: warm starts have their own benchmark (bench/warm.py)
            executor = SandboxExecutor(driver, REGISTRY, APP, policy=WarmPolicy(snapshots=False))
        worker = Worker(db, executor, WorkerConfig(concurrency=2, batch_size=batch_size, once=True))
        t0 = time.perf_counter()
        stats = worker.run()
        elapsed = time.perf_counter() - t0
        q.close()
        assert stats.done == jobs, stats
        return jobs / elapsed


def run(*, n: int = 60, jobs_per_size: dict[int, int] | None = None) -> dict[str, Any]:
    import bench.sandbox_app  # noqa: F401  (registers bench.sleep10)

    sizes = jobs_per_size or {1: 60, 10: 200, 100: 600}
    data_dir = Path(tempfile.mkdtemp(prefix="tenantq-bench-"))
    drivers: dict[str, SandboxDriver] = {}
    if runsc_works():
        drivers["gvisor"] = GVisorDriver(data_dir)
    if bwrap_works():
        drivers["process"] = ProcessDriver(data_dir)
    # Interleaved, one sample of each at a time, so drift in the machine's
    # load hits the floors and the drivers alike.
    raw: dict[str, list[float]] = {}
    overhead: dict[str, dict[str, list[float]]] = {name: {} for name in drivers}
    for _ in range(n):
        for label, samples in floors(1).items():
            raw.setdefault(label, []).extend(samples)
        for name, d in drivers.items():
            for part, samples in driver_overhead(d, 1).items():
                overhead[name].setdefault(part, []).extend(samples)
    table = Table(title=f"per-batch sandbox overhead, n={n} (ms)")
    for col in ("what", "p50", "p99", "vs floor (p50)"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for label, samples in raw.items():
        table.add_row(f"floor: {label}", f"{statistics.median(samples) * 1000:.0f}",
                      f"{_pct(samples, 0.99) * 1000:.0f}", "")
    floor_of = {"gvisor": "runsc do /bin/true", "process": "bwrap /bin/true"}
    for name, parts in overhead.items():
        floor = statistics.median(raw[floor_of[name]]) if floor_of[name] in raw else float("nan")
        for part, samples in parts.items():
            ratio = f"{statistics.median(samples) / floor:.2f}x" if part == "total" else ""
            label = f"tenantq {name}: {part.replace('_', ' ')}"
            table.add_row(label, f"{statistics.median(samples) * 1000:.0f}",
                          f"{_pct(samples, 0.99) * 1000:.0f}", ratio)
    console.print(table)
    throughput: dict[str, dict[int, float]] = {}
    try:
        for name in ("inline", *drivers):
            throughput[name] = {size: end_to_end(name, size, jobs, data_dir) for size, jobs in sizes.items()}
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    t2 = Table(title="end to end: 10 ms handler, concurrency 2, cold sandboxes, jobs/s")
    t2.add_column("executor")
    for size in sizes:
        t2.add_column(f"batch {size}", justify="right")
    for name, by_size in throughput.items():
        cells = []
        for size, rate in by_size.items():
            share = f" ({rate / throughput['inline'][size]:.0%} of inline)" if name != "inline" else ""
            cells.append(f"{rate:,.0f}{share}")
        t2.add_row(name, *cells)
    console.print(t2)
    with scratch_schema("info") as db:
        info = machine_info(db)
    payload = {"benchmark": "sandbox", "machine": info, "settings": {"n": n, "jobs_per_size": sizes},
               "floors_ms": {k: [s * 1000 for s in v] for k, v in raw.items()},
               "overhead_ms": {d: {p: [s * 1000 for s in v] for p, v in parts.items()}
                               for d, parts in overhead.items()},
               "jobs_per_second": throughput, "tenantq": tenantq.__version__}
    console.print(f"wrote {save('sandbox', payload)}")
    return payload
