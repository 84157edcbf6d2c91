"""Rate limits: token buckets in Postgres, shared by every worker.

A bucket limits a tenant (`tenantq tenant set T --rate 10/s --burst 20`),
one kind of a tenant (`--rate-kind reports.render=2/s`) or one kind across
every tenant (`tenantq kind set K --rate 50/s`). A job costs one token of
each bucket that covers it. The pick (fairness/picker.py) skips a tenant
whose bucket is empty, with no credit and no charge, so nobody else waits
for it; it sizes the batch by the tokens, keeps kinds whose buckets are
empty out of the claim and caps the others at their tokens, and spends
the tokens in the pick's own transaction.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tenantq.domain import validation
from tenantq.errors import InvalidInput
from tenantq.store.db import Conn
from tenantq.store.queries import sql
from tenantq.store.steps import Query, Steps

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|second|m|min|minute|h|hr|hour)\s*$")
_PER = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hr": 3600, "hour": 3600}
MAX_PER_SECOND = 1e6
MAX_BURST = 1e6


def parse_rate(value: object) -> float:
    """Tokens per second from `10/s`, `100/m`, `5000/h` (or a number per second)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        per_second = float(value)
    else:
        match = _RATE.fullmatch(str(value))
        if match is None:
            raise InvalidInput(f"rate must look like 10/s, 100/m or 5000/h, got {str(value)[:40]!r}")
        per_second = float(match[1]) / _PER[match[2]]
    if not (math.isfinite(per_second) and 0 < per_second <= MAX_PER_SECOND):
        raise InvalidInput(f"rate must be more than 0 and at most {MAX_PER_SECOND:g}/s, got {value!r}")
    return per_second


def parse_burst(value: object, per_second: float) -> float:
    """The bucket's size; by default one second of the rate (at least 1)."""
    if value is None:
        return max(1.0, per_second)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 1 <= value <= MAX_BURST:
        raise InvalidInput(f"burst must be a number from 1 to {MAX_BURST:g}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Limits:
    """What bounds one batch of a tenant, read (and locked) at the pick."""

    # whole tokens of the tenant's own bucket; None: no tenant limit
    tenant: int | None = None
    # kind -> whole tokens (the smaller of its tenant and global buckets)
    kinds: dict[str, int] = field(default_factory=dict)
    buckets: tuple[tuple[str, str], ...] = ()
    tenant_id: str = ""
    # kinds with a bucket shared by every tenant
    shared: tuple[str, ...] = ()
    # seconds until an empty bucket of these has a whole token
    refill_in: float | None = None

    @property
    def exhausted(self) -> list[str]:
        return sorted(k for k, n in self.kinds.items() if n < 1)


def for_claim(conn: Conn, tenant_id: str, kinds: list[str] | None, *, now: datetime | None = None,
              pending_kinds: list[str] | None = None) -> Limits:
    """The buckets of a batch of this tenant (of `kinds`: the worker's,
    None for any), locked. `pending_kinds`: what the tenant's queue holds
    (its kinds hint; None: unknown), so that it takes the turn of a shared
    kind only if it has jobs of that kind."""
    rows = conn.execute(sql("rate_limits", "for_claim"),
                        {"tenant_id": tenant_id, "kinds": kinds, "now": now}).fetchall()
    tenant: int | None = None
    per_kind: dict[str, int] = {}
    waiting: list[str] = []
    refill: list[float] = []
    for row in rows:
        tokens = float(str(row["tokens"]))
        whole = max(0, math.floor(tokens + 1e-9))
        if whole < 1 or row["others_turn"]:
            refill.append(refill_seconds(tokens, float(str(row["per_second"]))))
        if row["kind"] == "":
            tenant = whole
            continue
        kind = str(row["kind"])
        if row["tenant_id"] == "":
            # a kind shared by every tenant: one tenant may hold the turn
            # for its next token (`wait_turn`), so others cannot race it
            if row["others_turn"]:
                whole = 0
            elif whole < 1 and (pending_kinds is None or kind in pending_kinds):
                waiting.append(kind)
        per_kind[kind] = min(per_kind.get(kind, whole), whole)
    if waiting:
        conn.execute(sql("rate_limits", "wait_turn"), {"tenant_id": tenant_id, "kinds": waiting, "now": now})
    shared = tuple(str(r["kind"]) for r in rows if r["tenant_id"] == "")
    buckets = tuple((str(r["tenant_id"]), str(r["kind"])) for r in rows)
    return Limits(tenant, per_kind, buckets, tenant_id, shared, min(refill) if refill else None)


def refill_seconds(tokens: float, per_second: float) -> float:
    """Seconds until a bucket holding `tokens` has a whole one."""
    return max(0.0, (1.0 - tokens) / per_second) if per_second > 0 else 1.0


def take(conn: Conn, limits: Limits, claimed: Counter[str], *, now: datetime | None = None) -> None:
    """Spend one token per claimed job in every bucket that covers it."""
    spend: dict[tuple[str, str], float] = {}
    for bucket_tenant, kind in limits.buckets:
        if kind == "":
            spend[(bucket_tenant, kind)] = float(sum(claimed.values()))
        elif claimed.get(kind):
            spend[(bucket_tenant, kind)] = float(claimed[kind])
    spend = {k: n for k, n in spend.items() if n > 0}
    taken = [k for k in limits.shared if claimed.get(k)]
    if taken:  # its turn for those kinds' next token is used
        conn.execute(sql("rate_limits", "turn_taken"), {"tenant_id": limits.tenant_id, "kinds": taken})
    if spend:
        conn.execute(sql("rate_limits", "take"), {
            "tenant_ids": [t for t, _ in spend], "kinds": [k for _, k in spend],
            "ns": list(spend.values()), "now": now})


def set_steps(*, tenant: str | None, kind: str | None, rate: object, burst: object = None
              ) -> Steps[dict[str, Any]]:
    """Set a limit (rate None: remove it)."""
    tenant_id = "" if tenant is None else validation.tenant_id(tenant)
    kind_name = "" if kind is None else validation.kind(kind)
    if not tenant_id and not kind_name:
        raise InvalidInput("a rate limit is for a tenant, a tenant's kind, or a kind")
    if rate is None:
        gone = yield Query(sql("rate_limits", "clear"), {"tenant_id": tenant_id, "kind": kind_name})
        return {"tenant_id": tenant_id, "kind": kind_name, "removed": bool(gone)}
    per_second = parse_rate(rate)
    rows = yield Query(sql("rate_limits", "set"), {"tenant_id": tenant_id, "kind": kind_name,
                                                  "per_second": per_second,
                                                  "burst": parse_burst(burst, per_second)})
    return dict(rows[0])


def list_steps(tenant: str | None = None) -> Steps[list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = yield Query(sql("rate_limits", "list"), {"tenant_id": tenant})
    return rows


def waiting_steps(tenant_id: str, kind: str) -> Steps[list[str]]:
    """Why-waiting lines for a job whose buckets are empty: "rate limited
    (tenant acme, 10/s): next token in 0.4 s"."""
    rows = yield Query(sql("rate_limits", "for_job"), {"tenant_id": tenant_id, "kind": kind})
    out = []
    for row in rows:
        tokens, per_second = float(str(row["tokens"])), float(str(row["per_second"]))
        if tokens >= 1:
            continue
        if row["tenant_id"] and row["kind"]:
            scope = f"tenant {row['tenant_id']}, kind {row['kind']}"
        elif row["tenant_id"]:
            scope = f"tenant {row['tenant_id']}"
        else:
            scope = f"kind {row['kind']}, all tenants"
        out.append(f"rate limited ({scope}, {rate_text(per_second)}): next token in "
                   f"{(1 - tokens) / per_second:.1f} s")
    return out


def rate_text(per_second: float) -> str:
    if per_second >= 1:
        return f"{per_second:g}/s"
    if per_second * 60 >= 1:
        return f"{per_second * 60:g}/m"
    return f"{per_second * 3600:g}/h"
