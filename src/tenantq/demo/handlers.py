"""Handlers of the demo app: small real workloads (hashing, JSON), a flaky
one, poison ones (OOM, segfault, infinite loop) and a trusted inline one;
scene 3's monthly report, mallory's job that goes after another tenant's
orders, and the host function they read orders through.
Everything but `demo.audit_log` (and the host function) runs sandboxed."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from typing import Any

import tenantq


@tenantq.handler("demo.import_row", timeout=10, memory_mb=128)
def import_row(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """A bulk-import row: normalise and fingerprint it."""
    row = {k.lower(): str(v).strip() for k, v in payload.items()}
    digest = hashlib.sha256(json.dumps(row, sort_keys=True).encode()).hexdigest()
    return {"fingerprint": digest[:16]}


@tenantq.handler("demo.render_report", timeout=10, memory_mb=128)
def render_report(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """An interactive report: a few thousand rounds of hashing (~ms of CPU).
    It also says which secrets it could see: only its own tenant's."""
    h = hashlib.sha256(f"{ctx.tenant}:{payload.get('month')}".encode())
    for _ in range(int(payload.get("rounds", 2000))):
        h = hashlib.sha256(h.digest())
    return {"pages": 3, "checksum": h.hexdigest()[:12], "secrets_seen": sorted(ctx.env),
            "api_key_is_mine": ctx.env.get("API_KEY", "").startswith(f"{ctx.tenant}-")}


@tenantq.handler("demo.flaky_webhook", timeout=10, memory_mb=128)
def flaky_webhook(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Fails on its first attempt, then succeeds: a retry with backoff."""
    if ctx.attempt < 2:
        raise ConnectionError("upstream answered 503")
    return {"delivered_on_attempt": ctx.attempt}


@tenantq.handler("demo.parse_invoice", timeout=10, memory_mb=128)
def parse_invoice(payload: dict[str, Any], ctx: tenantq.JobContext) -> None:
    """Always fails: ends in the dead-letter list after its attempts."""
    raise ValueError(f"cannot parse invoice {payload.get('invoice')!r}")


@tenantq.handler("demo.resize_image", timeout=10, memory_mb=128)
def resize_image(payload: dict[str, Any], ctx: tenantq.JobContext) -> int:
    """Poison: asks for far more memory than its 128 MiB."""
    return len(bytearray(1024 * 1024 * 1024))


@tenantq.handler("demo.native_codec", timeout=10, memory_mb=128)
def native_codec(payload: dict[str, Any], ctx: tenantq.JobContext) -> None:
    """Poison: a native extension that segfaults."""
    ctypes.string_at(0)


@tenantq.handler("demo.sync_forever", timeout=2, memory_mb=128)
def sync_forever(payload: dict[str, Any], ctx: tenantq.JobContext) -> None:
    """Poison: never returns."""
    while True:
        pass


@tenantq.handler("demo.audit_log", isolation="inline")
def audit_log(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Trusted first-party code: runs in the worker process (the shared-fleet path)."""
    return {"logged": payload.get("event"), "worker_pid": os.getpid()}


def _fetch(url: str) -> str:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return f"{resp.status} {resp.read().decode()[:40]}"
    except urllib.error.HTTPError as exc:
        return f"{exc.code} {exc.reason}"
    except (urllib.error.URLError, OSError) as exc:
        return f"refused: {getattr(exc, 'reason', exc)}"


@tenantq.handler("demo.push_crm", timeout=20, memory_mb=128)
def push_crm(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Push a record to the tenant's CRM: allowed by its egress rules."""
    return {"crm": _fetch(payload["crm"])}


@tenantq.handler("demo.exfiltrate", timeout=20, memory_mb=128)
def exfiltrate(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """A hostile transform: tries another tenant's CRM and a paste site."""
    return {target: _fetch(target) for target in payload["targets"]}


# -- scene 3: tenant data through a host function ------------------------
# Imported in every sandbox too (the handlers are registered there); the
# host function only runs on the host, and needs no import of its own.
@tenantq.host_function("orders.for_month")
def orders_for_month(args: dict[str, Any], ctx: tenantq.HostContext) -> list[dict[str, Any]]:
    """Trusted app code, run in the dispatcher: the month's orders of
    ctx.tenant, which the host sets from the batch (never from the args).
    The query leaves the tenant to the row-level-security policy, so the
    tenant_id of each row a report gets shows what the policy let through;
    the month is a bound parameter: whatever the args hold is a value, never SQL."""
    with ctx.db() as conn:  # search_path is the demo's app schema (demo/appdb.py)
        rows = conn.execute("SELECT id, tenant_id, amount FROM orders WHERE month = %s ORDER BY id",
                            (args.get("month"),)).fetchall()
    return [{"id": i, "tenant": t, "amount": a} for i, t, a in rows]


def _summary(orders: list[dict[str, Any]]) -> dict[str, Any]:
    return {"orders": len(orders), "total": sum(int(o["amount"]) for o in orders),
            "tenants_seen": sorted({str(o["tenant"]) for o in orders})}


@tenantq.handler("report.monthly", host_functions=["orders.for_month"], timeout=20, memory_mb=128)
def monthly_report(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """A tenant's monthly report, sandboxed: no credential, no connection;
    its tenant's orders come through the host function."""
    return {"month": payload["month"], **_summary(ctx.call("orders.for_month", {"month": payload["month"]}))}


@tenantq.handler("report.snoop", host_functions=["orders.for_month"], timeout=20, memory_mb=128)
def snoop(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Hostile tenant code, sandboxed: goes after another tenant's orders
    every way it can and says what each try got."""
    victim, month = str(payload["victim"]), payload["month"]
    tries: list[tuple[str, str, dict[str, Any]]] = [
        ("the victim's id in the args", "orders.for_month", {"month": month, "tenant": victim,
                                                              "tenant_id": victim}),
        ("SQL in the args", "orders.for_month", {"month": f"{month} OR tenant_id = '{victim}'"}),
        ("a function it does not declare", "orders.export_all", {"tenant": victim}),
    ]
    attempts = []
    for what, name, args in tries:
        attempt: dict[str, Any] = {"try": what, "call": f"ctx.call({name!r}, {json.dumps(args)})"}
        try:
            attempt.update(_summary(ctx.call(name, args)))
        except tenantq.HostFunctionError as exc:
            attempt["error"] = f"HostFunctionError: {exc}"
        attempts.append(attempt)
    attempts.append(_database_itself(ctx, victim))
    return {"victim": victim, "attempts": attempts}


def _database_itself(ctx: tenantq.JobContext, victim: str) -> dict[str, Any]:
    """In a sandbox ctx.db() refuses (no route, no credential); on the
    demo's inline fallback it is the tenant-scoped connection, and the
    policy hides the victim's rows."""
    attempt: dict[str, Any] = {
        "try": "the database itself",
        "call": f"with ctx.db() as conn: SELECT ... FROM orders WHERE tenant_id = '{victim}'"}
    try:
        with ctx.db() as conn:
            rows = conn.execute("SELECT id, tenant_id, amount FROM orders WHERE tenant_id = %s",
                                (victim,)).fetchall()
        attempt.update(_summary([{"id": i, "tenant": t, "amount": a} for i, t, a in rows]))
    except tenantq.NoAppDatabase as exc:
        attempt["error"] = f"NoAppDatabase: {exc}"
    return attempt
