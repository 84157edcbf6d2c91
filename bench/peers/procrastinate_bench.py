"""Procrastinate adapter for the peer benchmarks (see peerlib.py for the scenarios).

Run with the peers' venv: ``bench/peers/.venv/bin/python bench/peers/procrastinate_bench.py fairness ...``.

How Procrastinate is used here, as its docs show it:
- ``App(connector=PsycopgConnector(conninfo=...))``: one psycopg_pool ``AsyncConnectionPool`` with
  psycopg_pool's defaults (4 connections) shared by producer and worker; while the worker runs, one of
  them is held for LISTEN (``listen_notify=True`` is the default);
- schema: ``app.schema_manager.apply_schema_async()``, what ``procrastinate schema --apply`` runs;
- enqueue: ``task.defer_async(**kwargs)`` for one job, ``task.batch_defer_async(*kwargs)`` for a batch
  (one ``procrastinate_defer_jobs_v1(array)`` call);
- worker: ``app.run_worker_async(concurrency=C)`` on stdlib asyncio (``procrastinate worker`` uses
  ``asyncio.run``). Every other worker option keeps its default (``wait=True``, 5 s polling fallback,
  ``delete_jobs="never"``), except ``install_signal_handlers=False``, which the docs prescribe when the
  worker runs as a task inside another program (here the benchmark handles SIGTERM);
- stop: cancelling the ``run_worker_async`` task is the documented graceful stop: running jobs finish.
Procrastinate fetches one job per query, so it has no batch size; ``--batch-size`` is ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from importlib.metadata import version
from typing import Any, ClassVar

from peerlib import Handler, JobPayload, Peer, log, main
from procrastinate import App, PsycopgConnector
from procrastinate.tasks import Task

TASK_NAME = "bench"
DEFAULT_POOL_SIZE = 4  # psycopg_pool.AsyncConnectionPool(min_size=4, max_size=None -> min_size)
# Best drain settings on a 2-core box, from a sweep of concurrency x pool size.
BEST_THROUGHPUT_CONCURRENCY = 8
BEST_THROUGHPUT_POOL_SIZE: int | None = None  # None: psycopg_pool's default


class ProcrastinatePeer(Peer):
    system: ClassVar[str] = "procrastinate"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        if getattr(args, "batch_size", None) is not None:
            log.warning("procrastinate fetches one job per query: ignoring --batch-size")
        self.app: App | None = None
        self.task: Task[Any, Any, Any] | None = None
        self.handler: Handler | None = None
        self.concurrency: int | None = None
        self.pool_size: int | None = None

    @property
    def version(self) -> str:
        return version("procrastinate")

    async def attach(self, dsn: str) -> None:
        pool_size = BEST_THROUGHPUT_POOL_SIZE if self.args.scenario == "throughput" else None
        # Extra PsycopgConnector kwargs go to AsyncConnectionPool; none given = its defaults.
        pool_kwargs: dict[str, Any] = {} if pool_size is None else {"min_size": pool_size}
        self.pool_size = pool_size or DEFAULT_POOL_SIZE
        self.app = App(connector=PsycopgConnector(conninfo=dsn, **pool_kwargs))

        # Task kwargs are the job's JSON args; the handler is bound later, by start_worker.
        @self.app.task(name=TASK_NAME)
        async def bench(tenant: str, seq: int) -> None:
            assert self.handler is not None
            await self.handler(JobPayload(tenant, seq))

        self.task = bench
        await self.app.open_async()

    async def install(self) -> None:
        assert self.app is not None
        await self.app.schema_manager.apply_schema_async()

    async def close(self) -> None:
        if self.app is not None:
            with contextlib.suppress(Exception):  # open_async may not have run
                await self.app.close_async()

    async def enqueue_one(self, job: JobPayload) -> None:
        assert self.task is not None
        await self.task.defer_async(**job.to_dict())

    async def enqueue_bulk(self, jobs: list[JobPayload]) -> None:
        assert self.task is not None
        await self.task.batch_defer_async(*(job.to_dict() for job in jobs))

    async def start_worker(self, handler: Handler, concurrency: int | None, scenario: str) -> None:
        assert self.app is not None
        self.handler = handler
        self.concurrency = concurrency if concurrency is not None else BEST_THROUGHPUT_CONCURRENCY
        self.worker_task = asyncio.create_task(
            self.app.run_worker_async(concurrency=self.concurrency, install_signal_handlers=False)
        )

    async def stop_worker(self) -> None:
        if self.worker_task is None:
            return
        self.worker_task.cancel()  # the worker turns this into a graceful stop, then re-raises
        with contextlib.suppress(asyncio.CancelledError):
            await self.worker_task

    async def count_completed(self) -> int:
        assert self.app is not None
        row = await self.app.connector.execute_query_one_async(
            "SELECT count(*) AS n FROM procrastinate_jobs WHERE status = 'succeeded'"
        )
        return int(row["n"])

    def settings(self) -> dict[str, Any]:
        return {
            "connector": "PsycopgConnector (psycopg_pool), producer and worker share it",
            "processes": self.args.processes if self.args.scenario == "throughput" else 1,
            "event_loop": "asyncio",
            "concurrency": self.concurrency,
            "pool_size": self.pool_size,
            "listen_notify": True,
            "fetch_job_polling_interval_s": 5.0,
            "batch_size": None,  # one job per fetch query
            "enqueue_bulk": "Task.batch_defer_async(*jobs): one call",
        }


if __name__ == "__main__":
    main(ProcrastinatePeer)
