"""What one `enqueue` costs, piece by piece: tenantq's call, its statements
alone, and a bare INSERT with none of tenantq's features, each on one
prepared autocommit connection to the same server (docs/benchmarks.md,
"Producers": the floor under single enqueue).

Variants are run interleaved, `rounds` short rounds of `n` calls, and the
median is reported, with each variant's time over `bare + NOTIFY`'s as the
median of the rounds' paired ratios (commit latency drifts over seconds on
the machines measured; both sides of a round's ratio see the same spell):
- `Queue.enqueue`: the public call (validation, pool, the statement);
- `one-job statement`: jobs.sql `insert_one` on psycopg's cursor (what
  `enqueue` runs inside a caller's transaction);
- `one-job statement, prepared call`: the same through libpq's
  prepared-statement call (store/prepared.py: what `enqueue` runs on an
  idle autocommit connection, its pool's included);
- `many-job statement`: jobs.sql `insert` (`enqueue_many`) for one job;
- `bare INSERT`: `INSERT INTO jobs ... RETURNING id`, no wake row, no
  NOTIFY: what psycopg reaches with no queue at all;
- `bare + NOTIFY`: the same with the workers' notification, the baseline
  of issue "producer-path" (an enqueue at most 1.3x its time);
- `bare + wake row + NOTIFY`: the same with a hand-written wake insert.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import psycopg
from rich.console import Console
from rich.table import Table

from bench.common import machine_info, save, scratch_schema
from tenantq import Queue
from tenantq.domain import validation
from tenantq.store import prepared
from tenantq.store.enqueue import _insert_params
from tenantq.store.queries import qualified

console = Console(width=120)

def _per_call_ms(call: Any, n: int) -> float:
    for _ in range(min(20, n)):
        call()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n * 1e3


def run(*, n: int = 150, rounds: int = 31) -> dict[str, Any]:
    payload = {"tenant": "t1", "seq": 1}
    text = '{"tenant": "t1", "seq": 1}'
    with scratch_schema("floor") as db:
        s = f'"{db.schema}"'
        statement = qualified("jobs", "insert", db.schema)
        job = validation.new_job("t1", "bench.noop", payload)
        params = _insert_params([job], channel=db.notify_channel, now=None)
        bare = (f"INSERT INTO {s}.jobs (tenant_id, kind, payload, priority, max_attempts, run_after, "
                "created_at) VALUES (%s, %s, %s::jsonb, %s, 5, now(), now()) RETURNING id")
        bare_args = ("t1", "bench.noop", text, "default")
        notify = f"WITH i AS ({bare}), n AS (SELECT pg_notify(%s, '')) SELECT id FROM i, n"
        woken = (f"WITH i AS ({bare}), w AS (INSERT INTO {s}.wakes (tenant_id, priority, kind, run_after) "
                 "SELECT %s, %s, %s, now() FROM i), n AS (SELECT pg_notify(%s, '')) SELECT id FROM i, n")
        one = qualified("jobs", "insert_one", db.schema)
        one_args = {"tenant_id": "t1", "kind": "bench.noop", "payload": text, "priority": "default",
                    "max_attempts": 5, "delay": 0.0, "key": None, "actor": None, "meta": None, "now": None,
                    "channel": db.notify_channel, "note": ""}
        queue = Queue(db.dsn, schema=db.schema)
        times: dict[str, list[float]] = {}
        with psycopg.connect(db.dsn, autocommit=True) as conn, \
                psycopg.connect(db.dsn, autocommit=True) as direct:
            def raw(sql: str, args: Any) -> Any:
                return lambda: conn.execute(sql, args, prepare=True).fetchall()
            variants = {
                "Queue.enqueue": lambda: queue.enqueue("t1", "bench.noop", payload),
                "one-job statement": raw(one, one_args),
                "one-job statement, prepared call": lambda: prepared.execute(direct, one, one_args),
                "many-job statement": raw(statement, params),
                "bare INSERT": raw(bare, bare_args),
                "bare + NOTIFY": raw(notify, (*bare_args, db.notify_channel)),
                "bare + wake row + NOTIFY": raw(woken, (*bare_args, "t1", "default", "bench.noop",
                                                        db.notify_channel)),
            }
            for _ in range(rounds):
                for name, call in variants.items():
                    times.setdefault(name, []).append(_per_call_ms(call, n))
        queue.close()
        machine = machine_info(db)
    base = times["bare + NOTIFY"]
    rows = {name: {"median_ms": statistics.median(v), "runs_ms": v,
                   "vs_bare_notify": statistics.median(a / b for a, b in zip(v, base, strict=True))}
            for name, v in times.items()}
    table = Table(title=f"one enqueue, ms per call (median of {rounds} x {n:,})")
    table.add_column("variant")
    table.add_column("ms", justify="right")
    table.add_column("per s", justify="right")
    table.add_column("/ bare + NOTIFY", justify="right")
    for name, row in rows.items():
        table.add_row(name, f"{row['median_ms']:.3f}", f"{1e3 / row['median_ms']:,.0f}",
                      f"{row['vs_bare_notify']:.2f}x")
    console.print(table)
    result = {"benchmark": "enqueue-floor", "machine": machine, "settings": {"n": n, "rounds": rounds},
              "results": rows}
    save("enqueue-floor", result)
    return result


if __name__ == "__main__":
    run()
