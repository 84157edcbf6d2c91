"""What one `enqueue` costs, piece by piece: tenantq's call, its statement
alone, and a bare INSERT with none of tenantq's features, each on one
prepared autocommit connection to the same server (docs/benchmarks.md,
"Throughput": the floor under single enqueue).

Variants are run interleaved, `rounds` times, and the median is reported:
- `Queue.enqueue`: the public call (validation, pool, the statement);
- `insert statement`: jobs.sql `insert` for one job, raw;
- `bare INSERT`: `INSERT INTO jobs ... RETURNING id`, no tenant row, no
  queue wake-up, no NOTIFY: what psycopg reaches with no queue at all;
- `bare + NOTIFY`, `bare + queue row lock`: one feature each;
- `one-job statement`: the `insert` statement written with scalar
  parameters for a single job (an experiment, not tenantq's code: what a
  second definition of the wake-up would buy);
- `insert statement, no FK`: the same after the jobs -> tenants foreign key
  is dropped (in the scratch schema only).
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
from tenantq.store import validation
from tenantq.store.enqueue import _insert_params
from tenantq.store.queries import qualified

console = Console(width=120)

ONE_JOB = """
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now,
           coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(delay)s::double precision) AS due
), new_tenant AS (
    INSERT INTO {s}.tenants (tenant_id) VALUES (%(tenant_id)s::text) ON CONFLICT (tenant_id) DO NOTHING
), woken AS (
    INSERT INTO {s}.queues AS q (tenant_id, priority, has_work, next_run_at, kinds, kinds_due)
    SELECT %(tenant_id)s::text, %(priority)s::text, true, clock.due,
           CASE WHEN %(delay)s::double precision <= 0 THEN ARRAY[%(kind)s::text] ELSE ARRAY[]::text[] END,
           CASE WHEN %(delay)s::double precision > 0 THEN clock.due ELSE 'infinity' END
    FROM clock
    ON CONFLICT (tenant_id, priority) DO UPDATE
        SET has_work = true, next_run_at = least(q.next_run_at, excluded.next_run_at),
            kinds = CASE WHEN NOT q.has_work THEN excluded.kinds WHEN q.kinds @> excluded.kinds THEN q.kinds
                         ELSE {s}.queue_kinds(q.kinds, excluded.kinds) END,
            kinds_due = CASE WHEN q.has_work THEN least(q.kinds_due, excluded.kinds_due)
                             ELSE excluded.kinds_due END
        WHERE NOT q.has_work OR q.next_run_at > excluded.next_run_at OR q.kinds_due > excluded.kinds_due
           OR (q.kinds IS NOT NULL AND (excluded.kinds IS NULL OR NOT q.kinds @> excluded.kinds))
), inserted AS (
    INSERT INTO {s}.jobs (tenant_id, kind, payload, priority, max_attempts, run_after, created_at)
    SELECT %(tenant_id)s, %(kind)s, %(payload)s::jsonb, %(priority)s, 5, clock.due, clock.now FROM clock
    RETURNING id
), wake AS (SELECT pg_notify(%(channel)s, '') FROM inserted)
SELECT id FROM inserted WHERE (SELECT count(*) FROM wake) >= 0
"""


def _per_call_ms(call: Any, n: int) -> float:
    for _ in range(min(50, n)):
        call()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n * 1e3


def run(*, n: int = 1_500, rounds: int = 3) -> dict[str, Any]:
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
        lock = (f"WITH q AS (SELECT 1 FROM {s}.queues WHERE tenant_id = %s AND priority = %s FOR UPDATE), "
                f"i AS ({bare}) SELECT id FROM i, (SELECT count(*) FROM q) AS z")
        one = ONE_JOB.replace("{s}", s)
        one_args = {"tenant_id": "t1", "kind": "bench.noop", "payload": text, "priority": "default",
                    "delay": 0.0, "now": None, "channel": db.notify_channel}
        queue = Queue(db.dsn, schema=db.schema)
        times: dict[str, list[float]] = {}
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            def raw(sql: str, args: Any) -> Any:
                return lambda: conn.execute(sql, args, prepare=True).fetchall()
            variants = {
                "Queue.enqueue": lambda: queue.enqueue("t1", "bench.noop", payload),
                "insert statement": raw(statement, params),
                "one-job statement": raw(one, one_args),
                "bare INSERT": raw(bare, bare_args),
                "bare + NOTIFY": raw(notify, (*bare_args, db.notify_channel)),
                "bare + queue row lock": raw(lock, ("t1", "default", *bare_args)),
            }
            conn.execute(statement, params).fetchall()  # the tenant and queue rows exist
            for _ in range(rounds):
                for name, call in variants.items():
                    times.setdefault(name, []).append(_per_call_ms(call, n))
            conn.execute(f"ALTER TABLE {s}.jobs DROP CONSTRAINT jobs_tenant_id_fkey")
            no_fk = raw(statement, params)
            times["insert statement, no FK"] = [_per_call_ms(no_fk, n) for _ in range(rounds)]
        queue.close()
        machine = machine_info(db)
    rows = {name: {"median_ms": statistics.median(v), "runs_ms": v} for name, v in times.items()}
    table = Table(title=f"one enqueue, ms per call (median of {rounds} x {n:,})")
    table.add_column("variant")
    table.add_column("ms", justify="right")
    table.add_column("per s", justify="right")
    for name, row in rows.items():
        table.add_row(name, f"{row['median_ms']:.3f}", f"{1e3 / row['median_ms']:,.0f}")
    console.print(table)
    result = {"benchmark": "enqueue-floor", "machine": machine, "settings": {"n": n, "rounds": rounds},
              "results": rows}
    save("enqueue-floor", result)
    return result


if __name__ == "__main__":
    run()
