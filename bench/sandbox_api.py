"""The Sandbox API's latencies (`./run bench sandbox-api`), interleaved:
each round measures every row once, in turn, so a slow minute of the
machine lands on every row alike.

Rows: `runsc do true` (the floor: runsc's own fastest start, nothing of
tenantq), `Sandbox.create` cold, create + the first `exec("true")`,
`exec("true")` in a running sandbox, `fork()` of a running parent (the
child ready for an exec) and the parent's pause during it, and the
bubblewrap driver's create and create + exec. For scale, the published
figures of the hosted microVM SDKs the issue names (not measured here).
"From the pool": `TENANTQ_POOL_SIZE=1`, the pool refilled (untimed) before
each take; "cold": the pool off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import machine_info, save, scratch_schema
from tenantq import Sandbox
from tenantq.sandbox import boot, templates
from tenantq.sandbox.api import API_LABEL
from tenantq.sandbox.drivers import bwrap_works, get_driver, runsc_works
from tenantq.sandbox.pool import pool, pool_key, wait_until_ready

console = Console(width=150)
HOSTED = [("hosted microVM SDK: create (published)", 179.0, 203.0),
          ("hosted microVM SDK: fork, same host (published)", 400.0, 750.0)]


def _runsc_do(runsc_root: Path) -> None:
    subprocess.run(["runsc", "--root", str(runsc_root), "--network=none", "--platform=ptrace", "do", "true"],
                   check=True, capture_output=True, timeout=60)


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {"p50": ordered[len(ordered) // 2], "p99": p99, "n": float(len(ordered))}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(*, n: int = 100, fork_every: int = 1) -> dict[str, Any]:
    with scratch_schema("sbxapi") as db:
        info = machine_info(db)
    drivers = [d for d, ok in (("gvisor", runsc_works()), ("process", bwrap_works())) if ok]
    samples: dict[str, list[float]] = {}

    def add(row: str, seconds: float) -> None:
        samples.setdefault(row, []).append(seconds)

    with tempfile.TemporaryDirectory(prefix="tenantq-bench-sbx-") as scratch:
        os.environ["TENANTQ_DATA_DIR"] = scratch
        runsc_root = Path(scratch) / "runsc-do"
        runsc_root.mkdir()
        os.environ["TENANTQ_POOL_SIZE"] = "1"  # these creates also start each driver's pool
        parents = {d: Sandbox.create(driver=d, ttl_seconds=3600) for d in drivers if d == "gvisor"}
        chosen = {d: get_driver(d, Path(scratch))[0] for d in drivers}
        base = templates.resolve(Path(scratch), "base")
        warm = {d: Sandbox.create(driver=d, ttl_seconds=3600) for d in drivers}
        try:
            for i in range(n):
                if "gvisor" in drivers:
                    add("runsc do true", _timed(lambda: _runsc_do(runsc_root)))
                for d in drivers:
                    os.environ["TENANTQ_POOL_SIZE"] = "0"
                    # no pool: under gVisor a restore of the template's checkpoint,
                    # under bubblewrap a boot (it has no checkpoints)
                    how = "restore" if d == "gvisor" else "cold boot"
                    t0 = time.perf_counter()
                    sbx = Sandbox.create(driver=d, ttl_seconds=120)
                    add(f"{d}: create, no pool ({how})", time.perf_counter() - t0)
                    assert sbx.run("true").ok
                    add(f"{d}: create, no pool ({how}) + first exec(true)", time.perf_counter() - t0)
                    sbx.delete()
                    if d == "gvisor":  # what the checkpoint saves: a boot without one
                        t0 = time.perf_counter()
                        sbx = boot._cold(Sandbox, chosen[d], base, boot.template_spec(
                            base, tenant="", memory_mb=512, cpus=1.0, ttl=120, labels={API_LABEL: "base"}),
                            env={}, timeout=60)
                        add(f"{d}: cold boot (no checkpoint)", time.perf_counter() - t0)
                        assert sbx.run("true").ok
                        add(f"{d}: cold boot (no checkpoint) + first exec(true)", time.perf_counter() - t0)
                        sbx.delete()
                    # the pool refills in the background between takes; the wait is not timed
                    os.environ["TENANTQ_POOL_SIZE"] = "1"
                    assert wait_until_ready(pool_key("base", d), 1, timeout=120)
                    t0 = time.perf_counter()
                    sbx = Sandbox.create(driver=d, ttl_seconds=120)
                    add(f"{d}: create from a non-empty pool", time.perf_counter() - t0)
                    assert sbx.run("true").ok
                    add(f"{d}: create from the pool + first exec(true)", time.perf_counter() - t0)
                    sbx.delete()
                    add(f"{d}: exec(true) in a running sandbox", _timed(lambda d=d: warm[d].run("true")))
                if "gvisor" in parents and i % fork_every == 0:
                    parent = parents["gvisor"]
                    t0 = time.perf_counter()
                    child = parent.fork(ttl_seconds=120)
                    add("gvisor: fork (child ready)", time.perf_counter() - t0)
                    add("gvisor: fork: parent paused", parent.last_fork.parent_paused_seconds)
                    assert child.run("true").ok
                    add("gvisor: fork + first exec(true) in the child", time.perf_counter() - t0)
                    child.delete()
        finally:
            for sbx in [*parents.values(), *warm.values()]:
                sbx.delete()
            pool().close()
            os.environ.pop("TENANTQ_DATA_DIR", None)
            os.environ.pop("TENANTQ_POOL_SIZE", None)
            shutil.rmtree(runsc_root, ignore_errors=True)
    rows = {row: _summary(values) for row, values in samples.items()}
    table = Table(title=f"Sandbox API latencies, ms (n = {n} each, interleaved; {info['cpus']} CPUs)")
    for column in ("row", "p50", "p99", "ratio of p50 to `runsc do true`"):
        table.add_column(column, justify="left" if column == "row" else "right")
    floor = rows.get("runsc do true", {}).get("p50")
    for row, stats in rows.items():
        ratio = f"{stats['p50'] / floor:.2f}x" if floor else "-"
        table.add_row(row, f"{stats['p50'] * 1000:.1f}", f"{stats['p99'] * 1000:.1f}", ratio)
    for row, p50, p99 in HOSTED:
        table.add_row(row, f"{p50:.0f}", f"{p99:.0f}", f"{p50 / 1000 / floor:.2f}x" if floor else "-")
    console.print(table)
    payload = {"benchmark": "sandbox-api", "machine": info, "settings": {"n": n, "drivers": drivers},
               "rows": rows, "hosted_published_ms": HOSTED}
    console.print(f"saved {save('sandbox-api', payload)}")
    return payload
