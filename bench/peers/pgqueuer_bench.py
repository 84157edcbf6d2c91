"""PgQueuer adapter for the peer benchmarks (see peerlib.py for the scenarios).

Run with the peers' venv: ``bench/peers/.venv/bin/python bench/peers/pgqueuer_bench.py fairness --dsn ...``.

How PgQueuer is used here, as its README shows it:
- asyncpg connections wrapped in ``AsyncpgDriver``; one for the producer (``Queries``), one for the worker
  (``PgQueuer``; it LISTENs on its connection for job NOTIFYs);
- schema: ``Queries.install()``, which is what ``pgq install`` runs (default durability: logged tables);
- enqueue: ``Queries.enqueue(entrypoint, payload)`` for one job; the list form
  ``Queries.enqueue([entrypoint...], [payload...], [priority...])`` is one INSERT ... UNNEST for a batch;
- worker: ``PgQueuer.run(batch_size=..., max_concurrent_tasks=...)`` on uvloop, as ``pgq run`` does;
  ``max_concurrent_tasks`` is the per-worker cap on picked jobs (enforced in the dequeue SQL) and is our
  "concurrency". PgQueuer requires ``max_concurrent_tasks >= 2 * batch_size``, so with a cap below 20
  the default batch size of 10 is lowered to ``concurrency // 2``.
- stop: set ``PgQueuer.shutdown`` (what its SIGINT/SIGTERM handlers do); in-flight jobs finish and the
  buffered status log is flushed before ``run`` returns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Coroutine
from datetime import timedelta
from importlib.metadata import version
from typing import Any, ClassVar

import asyncpg  # type: ignore[import-untyped]  # no stubs
import uvloop
from peerlib import Handler, JobPayload, Peer, main
from pgqueuer import PgQueuer, Queries
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job

ENTRYPOINT = "bench"
DEFAULT_BATCH_SIZE = 10  # PgQueuer.run / `pgq run --batch-size` default
DEFAULT_DEQUEUE_TIMEOUT = timedelta(seconds=30)  # PgQueuer.run default
# Best drain settings on a 2-core box, from a sweep of batch size x max_concurrent_tasks.
BEST_THROUGHPUT_BATCH_SIZE = 100
BEST_THROUGHPUT_CONCURRENCY: int | None = None  # None: no per-worker cap (PgQueuer's default)


def encode(job: JobPayload) -> bytes:
    return json.dumps(job.to_dict()).encode()


class PgQueuerPeer(Peer):
    system: ClassVar[str] = "pgqueuer"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.producer: asyncpg.Connection | None = None
        self.consumer: asyncpg.Connection | None = None
        self.queries: Queries | None = None
        self.pgq: PgQueuer | None = None
        self.batch_size = DEFAULT_BATCH_SIZE
        self.max_concurrent_tasks: int | None = None

    @property
    def version(self) -> str:
        return version("pgqueuer")

    @classmethod
    def run_async(cls, main: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        # `pgq run` runs the worker on uvloop when it is installed (it is a pgqueuer dependency).
        return uvloop.run(main)

    async def attach(self, dsn: str) -> None:
        self.dsn = dsn
        self.producer = await asyncpg.connect(dsn)
        self.queries = Queries(AsyncpgDriver(self.producer))

    async def install(self) -> None:
        assert self.queries is not None
        await self.queries.install()

    async def close(self) -> None:
        for conn in (self.producer, self.consumer):
            if conn is not None and not conn.is_closed():
                await conn.close()

    async def enqueue_one(self, job: JobPayload) -> None:
        assert self.queries is not None
        await self.queries.enqueue(ENTRYPOINT, encode(job))

    async def enqueue_bulk(self, jobs: list[JobPayload]) -> None:
        assert self.queries is not None
        await self.queries.enqueue([ENTRYPOINT] * len(jobs), [encode(j) for j in jobs], [0] * len(jobs))

    async def start_worker(self, handler: Handler, concurrency: int | None, scenario: str) -> None:
        if scenario == "throughput":
            self.batch_size = self.args.batch_size or BEST_THROUGHPUT_BATCH_SIZE
            best = BEST_THROUGHPUT_CONCURRENCY
            self.max_concurrent_tasks = concurrency if concurrency is not None else best
        else:
            self.max_concurrent_tasks = concurrency
        if self.max_concurrent_tasks:
            self.batch_size = max(1, min(self.batch_size, self.max_concurrent_tasks // 2))
        self.consumer = await asyncpg.connect(self.dsn)
        self.pgq = PgQueuer(AsyncpgDriver(self.consumer))

        @self.pgq.entrypoint(ENTRYPOINT)
        async def bench(job: Job) -> None:
            assert job.payload is not None
            await handler(JobPayload.from_dict(json.loads(job.payload)))

        self.worker_task = asyncio.create_task(
            self.pgq.run(batch_size=self.batch_size, max_concurrent_tasks=self.max_concurrent_tasks)
        )

    async def stop_worker(self) -> None:
        if self.pgq is None or self.worker_task is None:
            return
        self.pgq.shutdown.set()
        await self.worker_task

    async def count_completed(self) -> int:
        assert self.producer is not None and self.queries is not None
        log_table = self.queries.qbe.settings.queue_table_log
        count: int = await self.producer.fetchval(
            f"SELECT count(DISTINCT job_id) FROM {log_table} WHERE status = 'successful'"
        )
        return count

    def settings(self) -> dict[str, Any]:
        return {
            "driver": "asyncpg (AsyncpgDriver), producer and worker on separate connections",
            "processes": self.args.processes if self.args.scenario == "throughput" else 1,
            "event_loop": "uvloop",
            "batch_size": self.batch_size,
            "max_concurrent_tasks": self.max_concurrent_tasks,
            "dequeue_timeout_s": DEFAULT_DEQUEUE_TIMEOUT.total_seconds(),
            "durability": "durable (default)",
            "enqueue_bulk": "Queries.enqueue(list, list, list): one call",
        }


if __name__ == "__main__":
    main(PgQueuerPeer)
