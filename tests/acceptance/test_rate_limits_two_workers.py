"""Rate limits with a real fleet: two `tenantq worker` processes share the
token buckets in Postgres. Measured over a minute from the jobs table (the
database clock, the one the buckets use), never from the test's clock:

* tenant `limited` (10/s, burst 10, a backlog of 2,000 jobs) runs within 5%
  of its rate, and no window ever holds more than rate x length + burst;
* tenant `free` (no limit), one small job every 0.2 s, keeps the wait it had
  in the same test before the backlog arrived;
* kind `api.call`, limited to 6/s across tenants (a shared downstream API),
  holds that rate while tenants t1 and t2, with a backlog each, share it by
  turns (each 40-60% of it).

Both limits run at once, on different kinds (tests/apps/rated.py), so the
one slow minute covers them all. The limits are set before the baseline,
so the free tenant's picks are the same kind of pick (they read the
buckets) in both phases; only the limited backlogs differ.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest

from tenantq import JobSpec, Queue
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.acceptance.helpers import Cli, query, wait_exit, wait_for_text

APP = "tests.apps.rated"
NOOP, API = "rated.noop", "api.call"
LIMITED_RATE, LIMITED_BURST, LIMITED_BACKLOG = 10.0, 10.0, 2000
API_RATE, API_BURST, API_BACKLOG = 6.0, 6.0, 600  # per tenant, t1 and t2
FREE_EVERY = 0.2  # seconds between the free tenant's jobs
BASELINE_SECONDS = 5.0
WARMUP_SECONDS = 2.0  # the buckets' first bursts go out in it
WINDOW_SECONDS = 60.0
TOLERANCE = 0.05
# Wait bounds for the free tenant: x3 its baseline, or the baseline plus a
# slack, whichever is larger. Its job is picked as soon as a slot is free,
# which the noop batches of the limited tenants leave almost always; what
# they add is a pick or two on the shared cursor lock (milliseconds). Being
# held back behind them would show at the median (waiting for the limited
# tenant's next token: ~0.1 s > +0.05 s) or in the tail (a poll: 1 s >
# +0.3 s); the slacks absorb a descheduled worker on a busy 2-core machine
# (seen: p99 0.15 s beside other test runs, 0.01-0.03 s alone).
P50_SLACK, P99_SLACK = 0.05, 0.3


def _db_now(db: Database) -> datetime:
    value = query(db, "SELECT now() AS now")[0]["now"]
    assert isinstance(value, datetime)
    return value


def _enqueue_free_every(queue: Queue, seconds: float) -> list[int]:
    """One small job of tenant `free` every FREE_EVERY s for `seconds` s: a
    deadline loop on the monotonic clock (the cadence does not drift)."""
    tick = threading.Event()  # never set: its wait paces the loop
    start = time.monotonic()
    ids: list[int] = []
    while (due := start + len(ids) * FREE_EVERY) < start + seconds:
        tick.wait(max(0.0, due - time.monotonic()))
        ids.append(queue.enqueue("free", NOOP))
    return ids


def _jobs(db: Database) -> list[dict[str, Any]]:
    return query(db, "SELECT id, tenant_id, kind, status, created_at, started_at, finished_at FROM jobs")


def _percentile(values: list[float], p: float) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def _waits(rows: list[dict[str, Any]]) -> list[float]:
    return [(r["started_at"] - r["created_at"]).total_seconds() for r in rows]


def _most_in_any(times: list[datetime], length: float) -> int:
    """The most jobs started in any window of `length` seconds."""
    ordered = sorted(times)
    most, j = 0, 0
    for i, start in enumerate(ordered):
        j = max(j, i)
        while j + 1 < len(ordered) and (ordered[j + 1] - start).total_seconds() <= length:
            j += 1
        most = max(most, j - i + 1)
    return most


def _table(title: str, rows: list[tuple[str, str, str]]) -> str:
    lines = [title, f"{'measure':<38}{'got':>16}  expected"]
    lines += [f"{what:<38}{got:>16}  {expected}" for what, got, expected in rows]
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rate_limits_hold_across_two_workers_while_an_unlimited_tenant_keeps_its_wait(
        cli: Cli, db: Database, queue: Queue) -> None:
    queue.set_rate_limit("limited", rate=f"{LIMITED_RATE:g}/s", burst=LIMITED_BURST)
    queue.set_rate_limit(kind=API, rate=f"{API_RATE:g}/s", burst=API_BURST)
    workers = [cli.start("worker", "--app", APP, "--sandbox", "inline", "--concurrency", "2",
                         "--log-format", "text") for _ in range(2)]
    for _, err in workers:
        wait_for_text(err, "started: executor=inline", timeout=30)

    # 1. the free tenant alone: its baseline wait
    baseline_ids = set(_enqueue_free_every(queue, BASELINE_SECONDS))
    wait_until(lambda: query(db, "SELECT count(*) AS n FROM jobs WHERE status <> 'done'")[0]["n"] == 0,
               timeout=30, message="the baseline jobs done")

    # 2. the backlogs arrive; the free tenant goes on as before
    queue.enqueue_many([JobSpec("limited", NOOP) for _ in range(LIMITED_BACKLOG)]
                       + [JobSpec(t, API) for _ in range(API_BACKLOG) for t in ("t1", "t2")])
    arrived = query(db, "SELECT min(created_at) AS at FROM jobs WHERE tenant_id = 'limited'")[0]["at"]
    t0 = arrived + timedelta(seconds=WARMUP_SECONDS)
    t1 = t0 + timedelta(seconds=WINDOW_SECONDS)
    # past the window's end by a few jobs, so the window is full of them
    during_ids = set(_enqueue_free_every(queue, WARMUP_SECONDS + WINDOW_SECONDS + 0.6))
    wait_until(lambda: query(db, "SELECT count(*) AS n FROM jobs WHERE tenant_id = 'free' "
                                 "AND status <> 'done'")[0]["n"] == 0,
               timeout=30, message="every free job done")
    # jobs started before the window's end have finished (noop: milliseconds)
    wait_until(lambda: _db_now(db) > t1 + timedelta(seconds=1), timeout=30, message="the window over")
    for proc, _ in workers:
        proc.send_signal(signal.SIGTERM)
    for proc, err in workers:
        assert wait_exit(proc, timeout=60) == 0, err.read_text()[-3000:]

    rows = _jobs(db)
    assert not [r for r in rows if r["status"] not in ("done", "pending")], "nothing failed or hung"
    left = {t: sum(1 for r in rows if r["tenant_id"] == t and r["status"] == "pending")
            for t in ("limited", "t1", "t2")}
    assert all(left.values()), f"a backlog ran out before the window ended: {left}"

    def finished_in_window(tenant: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["tenant_id"] == tenant and r["finished_at"] is not None
                and t0 <= r["finished_at"] < t1]

    def started(tenant: str) -> list[datetime]:
        return [r["started_at"] for r in rows if r["tenant_id"] == tenant and r["started_at"] is not None]

    limited = len(finished_in_window("limited"))
    limited_rate = limited / WINDOW_SECONDS
    api = {t: len(finished_in_window(t)) for t in ("t1", "t2")}
    api_total = sum(api.values())
    api_rate = api_total / WINDOW_SECONDS
    shares = {t: n / api_total if api_total else 0.0 for t, n in api.items()}
    bursts = {
        "limited": {length: _most_in_any(started("limited"), length) for length in (1.0, 10.0)},
        API: {length: _most_in_any(started("t1") + started("t2"), length) for length in (1.0, 10.0)},
    }
    free_base = _waits([r for r in rows if r["id"] in baseline_ids])
    free_with = _waits([r for r in rows if r["id"] in during_ids and t0 <= r["created_at"] < t1])
    base_p50, base_p99 = _percentile(free_base, 50), _percentile(free_base, 99)
    with_p50, with_p99 = _percentile(free_with, 50), _percentile(free_with, 99)
    p50_bound = max(3 * base_p50, base_p50 + P50_SLACK)
    p99_bound = max(3 * base_p99, base_p99 + P99_SLACK)
    by_worker = query(db, "SELECT a.worker_id, count(*) AS n FROM attempts a "
                          "WHERE a.tenant_id = 'limited' GROUP BY a.worker_id ORDER BY a.worker_id")

    lb, ab = bursts["limited"], bursts[API]
    table = _table(f"rate limits over a {WINDOW_SECONDS:g} s window, two workers x 2 slots", [
        ("limited: jobs/s", f"{limited_rate:.3f}", f"{LIMITED_RATE:g} +-5%"),
        ("limited: most started in 1 s / 10 s", f"{lb[1.0]} / {lb[10.0]}",
         f"<= {LIMITED_RATE + LIMITED_BURST:g} / {LIMITED_RATE * 10 + LIMITED_BURST:g} (+1)"),
        ("limited: attempts by worker", " / ".join(str(r["n"]) for r in by_worker), "both work"),
        ("api.call: jobs/s (t1 + t2)", f"{api_rate:.3f}", f"{API_RATE:g} +-5%"),
        ("api.call: most started in 1 s / 10 s", f"{ab[1.0]} / {ab[10.0]}",
         f"<= {API_RATE + API_BURST:g} / {API_RATE * 10 + API_BURST:g} (+1)"),
        ("api.call: share t1 / t2", f"{shares['t1']:.3f} / {shares['t2']:.3f}", "0.4..0.6 each"),
        ("free: wait p50 baseline / with (s)", f"{base_p50:.3f} / {with_p50:.3f}", f"<= {p50_bound:.3f}"),
        ("free: wait p99 baseline / with (s)", f"{base_p99:.3f} / {with_p99:.3f}", f"<= {p99_bound:.3f}"),
        ("free: jobs baseline / with", f"{len(free_base)} / {len(free_with)}", ""),
    ])
    print("\n" + table)

    assert len(free_base) >= BASELINE_SECONDS / FREE_EVERY - 1 and len(free_with) >= 250, table
    assert len(by_worker) == 2, f"both workers should run the limited tenant's jobs\n{table}"
    # the tenant limit: within 5% of its rate, and never more than the bucket allows
    assert abs(limited_rate - LIMITED_RATE) <= TOLERANCE * LIMITED_RATE, table
    assert limited <= LIMITED_RATE * WINDOW_SECONDS + LIMITED_BURST, table
    # +1: a pick's started_at is its transaction's start, which may precede
    # that of a pick that took the cursor lock before it
    for length, most in bursts["limited"].items():
        assert most <= LIMITED_RATE * length + LIMITED_BURST + 1, table
    # the global kind limit: its rate across tenants, shared by turns
    assert abs(api_rate - API_RATE) <= TOLERANCE * API_RATE, table
    assert api_total <= API_RATE * WINDOW_SECONDS + API_BURST, table
    for length, most in bursts[API].items():
        assert most <= API_RATE * length + API_BURST + 1, table
    assert all(0.4 <= s <= 0.6 for s in shares.values()), table
    # the unlimited tenant keeps its normal wait
    assert with_p50 <= p50_bound, table
    assert with_p99 <= p99_bound, table
