"""One fresh sandbox per job (the "one throwaway sandbox per job" pattern):
a worker at `--batch-size 1` whose sandboxes are never reused, 200 ms jobs
of 4 tenants, against the same worker keeping its sandbox warm.

Modes (`bench.warm.MODES`): a sandbox booted per job ("cold"), restored from
the app's template per job ("restored", gVisor only), taken from a ready pool
of pristine restored sandboxes per job ("ready-pool", the worker's
`--ready-pool`, sized to its concurrency), and the reference, one sandbox per
slot kept warm and reused ("kept-warm"). Only kept-warm reuses a sandbox.

Two figures per mode: the time to first job of a one-job batch handed to the
executor (n samples, interleaved across modes; the pool refilled, untimed,
before each), and jobs/s of a real worker draining `jobs` jobs at batch 1,
concurrency 2, with the pool left to refill as it can (what a fleet gets).

Goal: a fresh sandbox per job costs at most 100 ms p50 more than a kept-warm
one (time to first job, ready pool vs kept warm).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import tenantq
from bench.common import machine_info, save, scratch_schema
from bench.warm import APP, MODES, _pct, drain, drivers_here, sample_first_jobs
from tenantq.dispatch.executors.sandboxed import SandboxExecutor
from tenantq.dispatch.executors.warm import WarmPolicy
from tenantq.registry import REGISTRY
from tenantq.sandbox.driver import SandboxDriver

console = Console(width=150)
KIND = "warmbench.sleep200"
CONCURRENCY = 2
TENANTS = 4
GOAL_MS = 100.0
REFERENCE = "kept-warm"


def _policy(mode: str) -> WarmPolicy:
    if mode == "ready-pool":  # one pristine sandbox ready per slot
        return WarmPolicy(snapshots=True, ready_pool=CONCURRENCY)
    return MODES[mode]


def _modes(driver: SandboxDriver) -> list[str]:
    fresh = ["cold", "restored", "ready-pool"] if driver.snapshots else ["cold", "ready-pool"]
    return [*fresh, REFERENCE]


def run(*, n: int = 15, jobs: int = 40) -> dict[str, Any]:
    import bench.warm_app  # noqa: F401  (registers warmbench.*)

    data_dir = Path(tempfile.mkdtemp(prefix="tenantq-bench-perjob-"))
    drivers = drivers_here(data_dir)
    ttfj: dict[str, dict[str, list[float]]] = {}
    rates: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for name, driver in drivers.items():
            executors = {mode: SandboxExecutor(driver, REGISTRY, APP, policy=_policy(mode))
                         for mode in _modes(driver)}
            try:
                if driver.snapshots:  # the template is built once per app version, untimed
                    ex = executors["restored"]
                    assert ex.warm.template(ex.spec("template", 60)) is not None, "template build failed"
                ttfj[name] = sample_first_jobs(executors, n, REFERENCE, KIND)
            finally:
                for ex in executors.values():
                    ex.close()
            rates[name] = {mode: drain(driver, _policy(mode), KIND, 1, jobs, CONCURRENCY)
                           for mode in _modes(driver)}
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    _print(ttfj, rates, n, jobs)
    with scratch_schema("info") as db:
        info = machine_info(db)
    payload = {"benchmark": "per-job", "machine": info,
               "settings": {"n": n, "jobs": jobs, "concurrency": CONCURRENCY, "tenants": TENANTS,
                            "job_ms": 200, "batch_size": 1},
               "time_to_first_job_ms": {d: {m: [s * 1000 for s in v] for m, v in by.items()}
                                        for d, by in ttfj.items()},
               "drain": rates, "tenantq": tenantq.__version__}
    console.print(f"wrote {save('per-job', payload)}")
    return payload


def _print(ttfj: dict[str, dict[str, list[float]]], rates: dict[str, dict[str, dict[str, float]]],
           n: int, jobs: int) -> None:
    table = Table(title=f"one fresh sandbox per job: 200 ms jobs, batch 1, {TENANTS} tenants, "
                        f"concurrency {CONCURRENCY}; time to first job n={n}, drain of {jobs} jobs")
    for col in ("driver", "sandbox per job", "first job p50 (ms)", "p99 (ms)", f"p50 - {REFERENCE} (ms)",
                "goal", "drain jobs/s", "vs kept-warm", "worker start to first job (s)"):
        table.add_column(col, justify="left" if col in ("driver", "sandbox per job") else "right")
    for name, by_mode in ttfj.items():
        reference = statistics.median(by_mode[REFERENCE])
        ref_rate = rates[name][REFERENCE]["jobs_per_s"]
        for mode, samples in by_mode.items():
            p50 = statistics.median(samples)
            extra = (p50 - reference) * 1000
            goal = "" if mode != "ready-pool" else (
                f"<= {GOAL_MS:.0f} ms " + ("met" if extra <= GOAL_MS else "MISSED"))
            drained = rates[name][mode]
            table.add_row(name, mode + (" (reused)" if mode == REFERENCE else ""), f"{p50 * 1000:.0f}",
                          f"{_pct(samples, 0.99) * 1000:.0f}", "" if mode == REFERENCE else f"{extra:+.0f}",
                          goal, f"{drained['jobs_per_s']:.2f}", f"{drained['jobs_per_s'] / ref_rate:.2f}x",
                          f"{drained['first_job_s']:.2f}")
    console.print(table)
