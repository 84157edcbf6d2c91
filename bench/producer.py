"""The producer's costs: what a job adds to a business transaction, and how
soon `wait()` wakes after a job ends.

1. Transactional enqueue: N business transactions (BEGIN; INSERT an order
   row; COMMIT) against the same transactions with `q.enqueue(..., conn=c)`
   between the INSERT and the COMMIT, interleaved round by round so both
   see the same server state; p50/p99 per transaction, sync (psycopg
   Connection + Queue) and async (AsyncConnection + AsyncQueue).
2. wait(): a job is settled (one statement, committed) while a waiter
   blocks in `wait()`; the latency is from the settle's commit returning to
   the waiter waking with the ended job. Sync (a thread) and async.
3. 1,000 concurrent async waiters: the connections the process holds.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from typing import Any

import psycopg
from rich.console import Console
from rich.table import Table

from bench.common import machine_info, save, scratch_schema
from tenantq import AsyncQueue, Queue
from tenantq.domain.records import Settlement
from tenantq.store import jobs
from tenantq.store.db import Database

console = Console(width=150)
ORDERS = "CREATE TABLE IF NOT EXISTS bench_orders (id bigserial PRIMARY KEY, tenant text, total numeric)"


def _pct(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def _ms(samples: list[float]) -> dict[str, float]:
    return {"p50_ms": _pct(samples, 50) * 1000, "p99_ms": _pct(samples, 99) * 1000,
            "mean_ms": statistics.fmean(samples) * 1000, "n": len(samples)}


def transactional_sync(db: Database, n: int) -> dict[str, list[float]]:
    plain: list[float] = []
    with_job: list[float] = []
    with Queue(db.dsn, schema=db.schema) as q, psycopg.connect(db.dsn) as conn:
        conn.execute(f"SET search_path = {db.schema}")
        conn.execute(ORDERS)
        conn.commit()
        for i in range(n):
            t0 = time.perf_counter()
            conn.execute("INSERT INTO bench_orders (tenant, total) VALUES (%s, %s)", (f"t{i % 10}", 10))
            conn.commit()
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            conn.execute("INSERT INTO bench_orders (tenant, total) VALUES (%s, %s) RETURNING id",
                         (f"t{i % 10}", 10))
            q.enqueue(f"t{i % 10}", "receipts.send", {"order": i}, actor="usr_1", conn=conn)
            conn.commit()
            with_job.append(time.perf_counter() - t0)
    return {"plain": plain, "with_job": with_job}


async def transactional_async(db: Database, n: int) -> dict[str, list[float]]:
    plain: list[float] = []
    with_job: list[float] = []
    async with AsyncQueue(db.dsn, schema=db.schema) as q:
        conn = await psycopg.AsyncConnection.connect(db.dsn)
        async with conn:
            await conn.execute(f"SET search_path = {db.schema}")
            await conn.execute(ORDERS)
            await conn.commit()
            for i in range(n):
                t0 = time.perf_counter()
                await conn.execute("INSERT INTO bench_orders (tenant, total) VALUES (%s, %s)",
                                   (f"t{i % 10}", 10))
                await conn.commit()
                plain.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await conn.execute("INSERT INTO bench_orders (tenant, total) VALUES (%s, %s)",
                                   (f"t{i % 10}", 10))
                await q.enqueue(f"t{i % 10}", "receipts.send", {"order": i}, conn=conn)
                await conn.commit()
                with_job.append(time.perf_counter() - t0)
    return {"plain": plain, "with_job": with_job}


def _settle_one(conn: psycopg.Connection[Any], tenant: str) -> float:
    batch = jobs.claim(conn, tenant_id=tenant, priority="default", limit=1, worker_id="bench",  # type: ignore[arg-type]
                       driver="none", lease_seconds=60)
    assert batch is not None
    jobs.settle(conn, batch.batch_id, [Settlement(batch.jobs[0].id, "done", result={"ok": True})],  # type: ignore[arg-type]
                end_outcome="ok")
    return time.perf_counter()


def wait_sync(db: Database, n: int) -> list[float]:
    latencies: list[float] = []
    with Queue(db.dsn, schema=db.schema) as q, db.connect() as conn:
        for i in range(n):
            tenant = f"w{i}"
            job_id = q.enqueue(tenant, "bench.noop")
            woke: list[float] = []
            waiting = threading.Event()

            def waiter(job: int = job_id, out: list[float] = woke, ready: threading.Event = waiting) -> None:
                ready.set()
                q.wait(job, timeout=30)
                out.append(time.perf_counter())

            thread = threading.Thread(target=waiter)
            thread.start()
            waiting.wait()
            # the waiter subscribes before it reads the status: give it the
            # moment to block (a settle before the subscription is also
            # caught, by the status read, but then there is no wake-up to time)
            deadline = time.monotonic() + 5
            while q._listener().waiting() == 0 and time.monotonic() < deadline:
                time.sleep(0.0005)
            time.sleep(0.002)
            settled = _settle_one(conn, tenant)
            thread.join()
            latencies.append(woke[0] - settled)
    return latencies


async def wait_async(db: Database, n: int) -> list[float]:
    latencies: list[float] = []
    async with AsyncQueue(db.dsn, schema=db.schema) as q:
        conn = db.connect()
        try:
            for i in range(n):
                tenant = f"a{i}"
                job_id = await q.enqueue(tenant, "bench.noop")
                task = asyncio.create_task(q.wait(job_id, timeout=30))
                while q._listener().waiting() == 0:
                    await asyncio.sleep(0.0005)
                await asyncio.sleep(0.002)
                settled = await asyncio.to_thread(_settle_one, conn, tenant)
                await task
                latencies.append(time.perf_counter() - settled)
        finally:
            conn.close()
    return latencies


async def many_waiters(db: Database, n: int) -> dict[str, Any]:
    """n concurrent waits: connections held by this process while they wait,
    and the time from one settle of all n jobs to the last waiter waking."""
    async with AsyncQueue(db.dsn, schema=db.schema) as q:
        from tenantq import JobSpec

        ids = await q.enqueue_many([JobSpec("many", "bench.noop") for _ in range(n)])
        tasks = [asyncio.create_task(q.wait(job_id, timeout=120)) for job_id in ids]
        deadline = time.monotonic() + 60
        while q._listener().waiting() < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        with db.connect() as conn:
            rows = conn.execute("SELECT application_name, count(*) AS n FROM pg_stat_activity "
                                "WHERE datname = current_database() AND application_name LIKE 'tenantq%%' "
                                "GROUP BY 1 ORDER BY 1").fetchall()
            batch = jobs.claim(conn, tenant_id="many", priority="default", limit=n, worker_id="bench",
                               driver="none", lease_seconds=60)
            assert batch is not None
            t0 = time.perf_counter()
            jobs.settle(conn, batch.batch_id, [Settlement(j.id, "done") for j in batch.jobs],
                        end_outcome="ok")
        await asyncio.gather(*tasks)
        return {"waiters": n, "connections": {str(r["application_name"]): int(str(r["n"])) for r in rows},
                "all_woken_s": time.perf_counter() - t0}


def run(*, transactions: int = 2_000, waits: int = 300, waiters: int = 1_000) -> dict[str, Any]:
    with scratch_schema("producer") as db:
        info = machine_info(db)
        sync_tx = transactional_sync(db, transactions)
        async_tx = asyncio.run(transactional_async(db, transactions))
        sync_wait = wait_sync(db, waits)
        async_wait = asyncio.run(wait_async(db, waits))
        many = asyncio.run(many_waiters(db, waiters))
    results = {
        "benchmark": "producer",
        "machine": info,
        "transactional": {
            "sync": {k: _ms(v) for k, v in sync_tx.items()},
            "async": {k: _ms(v) for k, v in async_tx.items()},
        },
        "wait": {"sync": _ms(sync_wait), "async": _ms(async_wait)},
        "many_waiters": many,
    }
    table = Table(title=f"Producer: one job per business transaction ({transactions} each), PostgreSQL "
                        f"{info['postgres']}, {info['cpus']} CPUs")
    for column in ("", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms"):
        table.add_column(column, justify="right" if column else "left")
    for side in ("sync", "async"):
        tx = results["transactional"][side]
        table.add_row(f"{side}: INSERT order; COMMIT", f"{tx['plain']['p50_ms']:.2f}",
                      f"{tx['plain']['p99_ms']:.2f}", "", "")
        table.add_row(f"{side}: INSERT order; enqueue(conn=); COMMIT", f"{tx['with_job']['p50_ms']:.2f}",
                      f"{tx['with_job']['p99_ms']:.2f}",
                      f"{tx['with_job']['p50_ms'] - tx['plain']['p50_ms']:+.2f}",
                      f"{tx['with_job']['p99_ms'] - tx['plain']['p99_ms']:+.2f}")
    console.print(table)
    wait_table = Table(title=f"wait(): settle commit -> waiter woken with the ended job ({waits} each)")
    for column in ("", "p50 ms", "p99 ms"):
        wait_table.add_column(column, justify="right" if column else "left")
    for side in ("sync", "async"):
        w = results["wait"][side]
        wait_table.add_row(side, f"{w['p50_ms']:.2f}", f"{w['p99_ms']:.2f}")
    console.print(wait_table)
    console.print(f"{waiters} concurrent async waiters: connections by application_name "
                  f"{many['connections']}; all woken {many['all_woken_s'] * 1000:.0f} ms after one settle")
    console.print(f"saved {save('producer', results)}")
    return results
