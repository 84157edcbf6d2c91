"""The job's envelope and `async def` handlers through a real worker, per
sandbox driver (and inline): ctx.actor and ctx.meta reach the handler
wherever it runs, and an async handler runs on an event loop of its own,
returns its result and fails like a plain one.

tests/apps/envelope.py has each handler twice: a sandboxed kind (the
default isolation) and an inline one, so one sandboxed worker shows both
paths; the results carry the uid they ran as (the guest uid in a sandbox)."""

from __future__ import annotations

import os
from typing import Any

from tenantq import JobSpec, Queue
from tenantq.sandbox.layout import GUEST_UID
from tests.acceptance.helpers import Cli
from tests.sandbox.conftest import worker_args

APP = "tests.apps.envelope"
TENANT = "acme"
WORKER_TIMEOUT = 120.0
META = {"request_id": "r-1", "plan": "pro", "nested": {"ids": [1, 2]}}


def _enqueue(queue: Queue, kinds: dict[str, str]) -> dict[str, int]:
    """One async job, one envelope job, one failing async job, one job
    without an envelope; `kinds` maps each role to the kind to use."""
    ids = queue.enqueue_many([
        JobSpec(TENANT, kinds["async"], {"x": 21}, actor="usr_async", meta=META),
        JobSpec(TENANT, kinds["whoami"], actor="usr_1", meta=META),
        JobSpec(TENANT, kinds["fail"], actor="usr_fail", max_attempts=1),
        JobSpec(TENANT, kinds["whoami"]),
    ])
    return dict(zip(["async", "whoami", "fail", "bare"], ids, strict=True))


def _check(queue: Queue, ids: dict[str, int], *, uid: int) -> None:
    infos = {role: queue.job(job_id) for role, job_id in ids.items()}
    for role in ("async", "whoami", "bare"):
        assert infos[role].status == "done", (role, infos[role].status, infos[role].last_error)
    ran_async: dict[str, Any] = infos["async"].result
    assert ran_async["doubled"] == 42 and ran_async["on_loop"] is True, ran_async
    assert (ran_async["actor"], ran_async["meta"]) == ("usr_async", META)
    assert ran_async["uid"] == uid, ran_async

    whoami: dict[str, Any] = infos["whoami"].result
    assert (whoami["actor"], whoami["meta"], whoami["tenant"]) == ("usr_1", META, TENANT)
    assert whoami["job"] == ids["whoami"] and whoami["uid"] == uid, whoami
    # the envelope is stored with the job too
    assert (infos["whoami"].actor, infos["whoami"].meta) == ("usr_1", META)

    bare: dict[str, Any] = infos["bare"].result
    assert (bare["actor"], bare["meta"]) == (None, {}), bare

    failed = infos["fail"]
    assert failed.status == "dead" and failed.attempts == 1, failed
    assert (failed.last_error or "").startswith("ValueError: async boom for usr_fail"), failed.last_error


SANDBOXED = {"async": "env.async_double", "whoami": "env.whoami", "fail": "env.async_fail"}
INLINE = {"async": "env.async_double_inline", "whoami": "env.whoami_inline", "fail": "env.async_fail_inline"}


def test_async_handlers_and_the_envelope_in_the_sandbox(driver_name: str, cli: Cli, queue: Queue) -> None:
    sandboxed = _enqueue(queue, SANDBOXED)
    inline = _enqueue(queue, INLINE)  # isolation="inline" kinds: in the worker's process
    res = cli.run(*worker_args(APP, driver_name, "--once", "--concurrency", "1", "--batch-size", "10"),
                  timeout=WORKER_TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    _check(queue, sandboxed, uid=GUEST_UID)
    _check(queue, inline, uid=os.getuid())
    # the sandboxed async job ran in another process than the inline one
    assert queue.job(sandboxed["async"]).result["pid"] != queue.job(inline["async"]).result["pid"]


def test_async_handlers_and_the_envelope_on_an_inline_worker(cli: Cli, queue: Queue) -> None:
    """--sandbox inline: the sandbox-isolation kinds run in the worker's process too."""
    sandboxed = _enqueue(queue, SANDBOXED)
    inline = _enqueue(queue, INLINE)
    res = cli.run(*worker_args(APP, "inline", "--once", "--concurrency", "1"), timeout=WORKER_TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    _check(queue, sandboxed, uid=os.getuid())
    _check(queue, inline, uid=os.getuid())
    pids = {queue.job(ids["async"]).result["pid"] for ids in (sandboxed, inline)}
    assert len(pids) == 1, "an inline worker runs every job in its own process"


def test_async_jobs_sharing_a_process_get_a_loop_each(driver_name: str, cli: Cli, queue: Queue) -> None:
    """process="batch": consecutive async jobs of a kind run in one process,
    each on a fresh event loop, closed after it."""
    ids = queue.enqueue_many([JobSpec(TENANT, "env.async_batch", actor=f"usr_{i}", meta={"i": i})
                              for i in range(3)])
    res = cli.run(*worker_args(APP, driver_name, "--once", "--concurrency", "1", "--batch-size", "10"),
                  timeout=WORKER_TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    results = [queue.job(job_id).result for job_id in ids]
    assert [(r["actor"], r["meta"]) for r in results] == [(f"usr_{i}", {"i": i}) for i in range(3)]
    assert len({r["pid"] for r in results}) == 1, results
    assert all(r["closed_before"] for r in results), results
    assert all(r["uid"] == GUEST_UID for r in results), results
