"""Run benchmarks by name: `python -m bench [--small] [name ...]`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from bench import (
    boundary,
    chaos,
    egress,
    egress_flood,
    enqueue_floor,
    fairness,
    host_connections,
    host_functions,
    per_job,
    producer,
    producers,
    sandbox,
    sandbox_api,
    scale,
    scaling,
    soak,
    throughput,
    warm,
)

BENCHMARKS: dict[str, Callable[..., dict[str, Any]]] = {
    "throughput": throughput.run,
    "scaling": scaling.run,
    "scale": scale.run,
    "fairness": fairness.run,
    "sandbox": sandbox.run,
    "chaos": chaos.run,
    "warm": warm.run,
    "per-job": per_job.run,
    "egress": egress.run,
    "egress-flood": egress_flood.run,
    "boundary": boundary.run,
    "producer": producer.run,
    "soak": soak.run,
    "sandbox-api": sandbox_api.run,
    "host-functions": host_functions.run,
    "host-connections": host_connections.run,
    "enqueue-floor": enqueue_floor.run,
    "producers": producers.run,
}
SMALL: dict[str, dict[str, Any]] = {
    "throughput": {"jobs": 200, "single": 20, "repeats": 1, "peers": False, "grid": False, "big": 300},
    "scaling": {"picks": 5, "max_pending": 1_000},
    "scale": {"processes": (1, 2), "batches": (10,), "kinds": ("no-op",), "jobs": {"no-op": 3_000},
              "warmup": 0.5, "seconds": 1.0},
    "fairness": {"whales": (200,), "peers": False, "small_jobs": 2, "weights_run": 300, "plot": False},
    "sandbox": {"n": 2, "jobs_per_size": {1: 2, 10: 10}},
    "egress": {"n": 20, "setups": 5},
    "egress-flood": {"names": 60, "seconds": 10.0, "rate": 20.0, "concurrency": 16, "baseline_seconds": 3.0,
                     "after_seconds": 1.0},
    "warm": {"n": 1, "jobs_per_size": {1: 2}},
    "per-job": {"n": 1, "jobs": 2},
    "boundary": {"drivers": ("process",)},
    "producer": {"transactions": 20, "waits": 5, "waiters": 20},
    "soak": {"total": 6_000, "rate": 3_000.0, "interval": 1.0, "workers": 1, "warmup": 0, "compare": False,
             "probes": 20,
             "plot": False},
    "sandbox-api": {"n": 2},
    "chaos": {"jobs": 60, "kills": 1, "postgres_restart": False, "healthy_jobs": 4, "waves": 1},
    "host-functions": {"rounds": 2, "trivial_calls": 20, "select_calls": 10, "warmup": 2, "tenants": 2,
                       "rows_per_tenant": 150},
    "host-connections": {"batches": 6, "pool": 2, "quick": 2},
    "enqueue-floor": {"n": 20, "rounds": 1},
    "producers": {"n": 20, "percall_rounds": 1, "rounds": 1, "producers": (2,), "tenants": (1, 5),
                  "work_ms": (0, 2), "seconds": 0.3, "warmup": 0.1, "peers": False},
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("names", nargs="*", choices=[*BENCHMARKS, []], help="default: all")
    parser.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args()
    for name in args.names or list(BENCHMARKS):
        BENCHMARKS[name](**(SMALL[name] if args.small else {}))


if __name__ == "__main__":
    main()
