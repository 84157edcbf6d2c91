"""Run one batch's jobs inside the sandbox (the forked batch child of the
guest runner). Stdlib only.

Appends one flushed JSON line per job to WORK_DIR/results.jsonl when it
starts and when it ends:

    {"id": 7, "status": "started"}
    {"id": 7, "status": "ok", "result": ..., "seconds": 0.01}
    {"id": 7, "status": "error", "error": "...", "reason": "exception|timeout|oom|unknown_kind", ...}

so a sandbox that dies mid-batch loses no finished result and names the job
it died on. Each handler's own timeout is enforced here with an interval
timer (the host enforces the batch's wall-clock budget as a backstop) and its
memory with RLIMIT_AS (the sandbox's memory cgroup is the backstop).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import time
import traceback
from types import FrameType
from typing import Any

TRACEBACK_LINES = 12
RESULTS_FILE = "results.jsonl"
BATCH_FILE = "batch.json"
STOP_FILE = "stop"


class JobTimeout(BaseException):
    """Raised in the handler when its timeout fires (BaseException, so a
    handler's `except Exception` cannot swallow it)."""


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise JobTimeout()


def emit(out: Any, record: dict[str, Any]) -> None:
    # flush, not fsync: the line only has to outlive the sandbox, and the
    # work dir lives on the host (an fsync per line costs milliseconds)
    out.write(json.dumps(record, default=repr) + "\n")
    out.flush()


def describe(exc: BaseException) -> str:
    head = f"{type(exc).__name__}: {exc}"
    tail = traceback.format_exception(exc)[-TRACEBACK_LINES:]
    return head + "\n" + "".join(tail).rstrip()


def _address_space() -> int:
    """Current virtual memory size of this process, in bytes."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[0])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _limit_memory(memory_mb: int, baseline: int) -> None:
    limit = baseline + memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


def _unlimit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_jobs(work_dir: str, secrets: dict[str, str], *, sync_starts: bool = False) -> int:
    """Run WORK_DIR/batch.json job by job; 0 when every job was reported.

    `sync_starts`: fsync each job's start line before the job runs, so the
    host knows which job is running before the job's first network request
    reaches the egress proxy (gVisor may hold a flushed write in its own
    cache for a while; the host applies the job's handler's egress rules).
    """
    from tenantq.registry import REGISTRY, JobContext

    with open(os.path.join(work_dir, BATCH_FILE)) as fh:
        batch = json.load(fh)
    stop_file = os.path.join(work_dir, STOP_FILE)
    signal.signal(signal.SIGALRM, _on_alarm)
    baseline = _address_space()
    batch_pid = os.getpid()
    with open(os.path.join(work_dir, RESULTS_FILE), "a") as out:
        for job in batch["jobs"]:
            if os.path.exists(stop_file):  # the host asked us to stop between jobs
                break
            emit(out, {"id": job["id"], "status": "started"})
            if sync_starts:
                os.fsync(out.fileno())
            started = time.monotonic()
            handler = REGISTRY.get(job["kind"])
            if handler is None:
                emit(out, {"id": job["id"], "status": "error", "reason": "unknown_kind", "seconds": 0.0,
                           "error": f"unknown kind {job['kind']!r}: no handler registered "
                                    f"(known: {', '.join(REGISTRY.kinds()) or 'none'})"})
                continue
            ctx = JobContext(tenant=batch["tenant"], job_id=job["id"], attempt=job["attempt"],
                             kind=job["kind"], max_attempts=job["max_attempts"], env=dict(secrets))
            record: dict[str, Any]
            try:
                _limit_memory(handler.memory_mb, baseline)
                signal.setitimer(signal.ITIMER_REAL, handler.timeout)
                try:
                    result = handler.func(job["payload"], ctx)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    _unlimit_memory()
                json.dumps(result, allow_nan=False)  # fail here, not on the host, if unstorable
                record = {"id": job["id"], "status": "ok", "result": result}
            except JobTimeout:
                record = {"id": job["id"], "status": "error", "reason": "timeout",
                          "error": f"timeout after {handler.timeout:g} s"}
            except MemoryError as exc:
                _unlimit_memory()
                detail = describe(exc).split("\n", 1)[-1]
                record = {"id": job["id"], "status": "error", "reason": "oom",
                          "error": f"oom: exceeded {handler.memory_mb} MiB (MemoryError)\n{detail}"}
            except BaseException as exc:
                record = {"id": job["id"], "status": "error", "reason": "exception", "error": describe(exc)}
            if os.getpid() != batch_pid:
                # a process the handler forked got here (a fork bomb's child
                # whose fork failed): it must never report or run the next job
                os._exit(1)
            record["seconds"] = time.monotonic() - started
            emit(out, record)
    return 0
