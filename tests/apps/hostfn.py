"""Handlers that call host functions, and the host functions they call
(tests/sandbox/test_host_functions.py, tests/integration/test_host_functions.py).

Imported in the sandbox too (the handlers are registered there): the host
functions' own imports (psycopg) happen only when they run, on the host.
The app's schema is TQ_TEST_APP_SCHEMA in the worker's environment."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import tenantq

ALL = ["orders.for_month", "context.switch", "slow", "big", "boom", "noop"]


def _orders(conn: Any, after: int | None = None) -> list[int]:
    from psycopg import sql

    query = sql.SQL("SELECT id FROM {}.orders WHERE id > %s ORDER BY id").format(
        sql.Identifier(os.environ["TQ_TEST_APP_SCHEMA"]))
    return [r[0] for r in conn.execute(query, (after or 0,)).fetchall()]


@tenantq.host_function("orders.for_month")
def orders_for_month(args: dict[str, Any], ctx: tenantq.HostContext) -> dict[str, Any]:
    """A tenant's orders: the tenant is ctx.tenant, whatever args say."""
    with ctx.db() as conn:
        setting = conn.execute("SELECT current_setting('app.current_tenant_id', true)").fetchone()
        return {"ids": _orders(conn), "tenant": ctx.tenant, "actor": ctx.actor,
                "setting": setting[0] if setting else None}


@tenantq.host_function("orders.everyone")
def everyone(args: dict[str, Any], ctx: tenantq.HostContext) -> str:
    """Registered, but no handler declares it."""
    return "every tenant's orders"


@tenantq.host_function("context.switch")
def switch(args: dict[str, Any], ctx: tenantq.HostContext) -> bool:
    """Tries to move later calls to another tenant: a session-level setting."""
    with ctx.db() as conn:
        conn.execute("SELECT set_config('app.current_tenant_id', %s, false)", (str(args.get("tenant")),))
    return True


@tenantq.host_function("slow", timeout=0.5)
def slow(args: dict[str, Any], ctx: tenantq.HostContext) -> None:
    threading.Event().wait(2.0)  # longer than its timeout


@tenantq.host_function("big")
def big(args: dict[str, Any], ctx: tenantq.HostContext) -> str:
    return "x" * (2 << 20)


@tenantq.host_function("boom")
def boom(args: dict[str, Any], ctx: tenantq.HostContext) -> None:
    raise ValueError("no such month")


@tenantq.host_function("noop")
def noop(args: dict[str, Any], ctx: tenantq.HostContext) -> int:
    return 1


def _attempt(ctx: tenantq.JobContext, name: str, args: Any) -> dict[str, Any]:
    try:
        return {"ok": ctx.call(name, args)}
    except tenantq.HostFunctionError as exc:
        return {"error": str(exc)}


@tenantq.handler("hostfn.report", host_functions=ALL, timeout=60)
def report(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    other = payload.get("other")
    return {
        "mine": ctx.call("orders.for_month", {"tenant": other, "tenant_id": other}),
        "undeclared": _attempt(ctx, "orders.everyone", {}),
        "unknown": _attempt(ctx, "no.such", {}),
        "switch": _attempt(ctx, "context.switch", {"tenant": other}),
        "after_switch": ctx.call("orders.for_month", {}),
        "boom": _attempt(ctx, "boom", {}),
        "slow": _attempt(ctx, "slow", {}),
        "big": _attempt(ctx, "big", {}),
        "huge_args": _attempt(ctx, "noop", {"pad": "x" * (10 << 20)}),
        "not_an_object": _attempt(ctx, "noop", [1, 2]),
    }


@tenantq.handler("hostfn.flood", host_functions=["noop"], timeout=120)
def flood(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    results = [_attempt(ctx, "noop", {}) for _ in range(int(payload["calls"]))]
    ok = sum(1 for r in results if "ok" in r)
    errors = sorted({r["error"] for r in results if "error" in r})
    return {"ok": ok, "errors": errors}


@tenantq.handler("hostfn.nocalls", timeout=30)
def nocalls(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """Declares nothing: ctx.call refuses, and so does the host when the job
    writes the request on the socket itself."""
    out: dict[str, Any] = {"ctx": _attempt(ctx, "orders.for_month", {})}
    from tenantq.guest.jobs import HOST_FUNCTIONS_SOCKET, FrameFile

    if os.path.exists(HOST_FUNCTIONS_SOCKET):
        body = b'{"name": "orders.for_month", "args": {}}'
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(HOST_FUNCTIONS_SOCKET)
            conn.sendall(b"%010d\n" % len(body) + body)
            out["raw"] = FrameFile(conn.fileno()).read()
    return out


@tenantq.handler("hostfn.mixed", host_functions=["noop", "boom"], timeout=30)
def mixed(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """One call of each outcome: ok, error (the function raised), refused
    (not declared); what its attempt's record and its batch's must count."""
    return {name: _attempt(ctx, name, {"pad": "x" * 100}) for name in ("noop", "boom", "orders.everyone")}


@tenantq.handler("hostfn.badnames", host_functions=["noop"], timeout=30)
def badnames(payload: Any, ctx: tenantq.JobContext) -> int:
    """Names no function can have (a NUL, markup, too long): refused, and
    recorded as "?" (the attempt's row must still be storable)."""
    refused = 0
    for name in ("no\x00pe", "<b>x</b>", "n" * 300, "noop\u202e"):
        try:
            ctx.call(name, {})
        except tenantq.HostFunctionError:
            refused += 1
    return refused
