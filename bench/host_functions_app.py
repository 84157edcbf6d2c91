"""The host-functions benchmark's app (`./run bench host-functions`).

One handler makes `n` calls of one host function in a loop and times each
round trip with `time.perf_counter` around `ctx.call`, where the handler
runs: in the sandbox (guest-side latency: the guest's connect, request,
the host's gate and function, the reply) or, on an inline worker, in the
dispatcher. The same code runs in every mode.

Imported in the sandbox too (the handler is registered there): the host
functions' own imports (psycopg) happen only when they run, on the host.
`SCHEMA` is set on the host by bench/host_functions.py before any job runs.
"""

from __future__ import annotations

import time
from typing import Any

import tenantq

NOOP = "hostfnbench.noop"
ORDERS = "hostfnbench.orders"
KIND = "hostfnbench.calls"
# the most calls one job makes (a batch gets 1,000 by default)
MAX_CALLS = 1000
# the app database's schema (its orders table), set by the bench on the host
SCHEMA: str | None = None


def select_orders(schema: str) -> Any:
    """The realistic query: one page of the tenant's orders. No WHERE on the
    tenant: row-level security scopes it (docs/tenant-data.md)."""
    from psycopg import sql

    return sql.SQL("SELECT id, customer, amount_cents, status, created_at::text FROM {}.orders "
                   "ORDER BY id LIMIT 100").format(sql.Identifier(schema))


@tenantq.host_function(NOOP)
def noop(args: dict[str, Any], ctx: tenantq.HostContext) -> dict[str, Any]:
    """The trivial one: no work, an empty JSON object back."""
    return {}


@tenantq.host_function(ORDERS)
def orders(args: dict[str, Any], ctx: tenantq.HostContext) -> list[dict[str, Any]]:
    """100 of the job's tenant's orders, through ctx.db() (RLS, the bench's role)."""
    if SCHEMA is None:
        raise RuntimeError("bench.host_functions_app.SCHEMA is not set")
    with ctx.db() as conn:
        rows = conn.execute(select_orders(SCHEMA)).fetchall()
    return [{"id": r[0], "customer": r[1], "amount_cents": r[2], "status": r[3], "created_at": r[4]}
            for r in rows]


@tenantq.handler(KIND, timeout=120, memory_mb=128, host_functions=[NOOP, ORDERS])
def calls(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """`n` calls of `payload["function"]`: each round trip's seconds, and the
    number of rows (or keys) the last call returned."""
    name = str(payload["function"])
    n = max(1, min(int(payload["n"]), MAX_CALLS))
    seconds: list[float] = []
    result: Any = None
    for _ in range(n):
        started = time.perf_counter()
        result = ctx.call(name, {})
        seconds.append(time.perf_counter() - started)
    return {"seconds": seconds, "rows": len(result) if isinstance(result, list | dict) else -1}
