"""The guest runner: runs one batch inside a sandbox. Stdlib only.

    python runner.py WORK_DIR [--ttl SECONDS]   (secrets: one JSON line on stdin)

Reads WORK_DIR/batch.json, imports the app (which registers handlers with
`@tenantq.handler`), runs the jobs one by one and appends one flushed JSON
line per job to WORK_DIR/results.jsonl when it starts and when it ends:

    {"id": 7, "status": "started"}
    {"id": 7, "status": "ok", "result": ..., "seconds": 0.01}
    {"id": 7, "status": "error", "error": "...", "reason": "exception|timeout|oom|unknown_kind", ...}

so a sandbox that dies mid-batch loses no finished result and names the job
it died on. Each handler's own timeout is enforced here with an interval
timer (the host enforces the batch's wall-clock budget as a backstop) and its
memory with RLIMIT_AS (the sandbox's memory cgroup is the backstop).
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import sys
import time
import traceback
from types import FrameType
from typing import Any

TRACEBACK_LINES = 12


class JobTimeout(BaseException):
    """Raised in the handler when its timeout fires (BaseException, so a
    handler's `except Exception` cannot swallow it)."""


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise JobTimeout()


def _emit(out: Any, record: dict[str, Any]) -> None:
    # flush, not fsync: the line only has to outlive the sandbox, and the
    # work dir lives on the host (an fsync per line costs milliseconds)
    out.write(json.dumps(record, default=repr) + "\n")
    out.flush()


def _describe(exc: BaseException) -> str:
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


def _start_ttl_watchdog(seconds: float) -> None:
    """The runner is the sandbox's init: when it exits, the sandbox ends. A
    daemon thread ends it at the deadline even if the dispatcher is gone and
    a job ignores every signal (the reaper is the backstop for a job that
    starves this thread)."""
    import threading

    exit_now = os._exit  # bound before any tenant code runs

    def expire() -> None:
        time.sleep(seconds)
        exit_now(137)

    threading.Thread(target=expire, name="ttl", daemon=True).start()


def main(work_dir: str, ttl_seconds: float | None = None) -> int:
    if ttl_seconds:
        _start_ttl_watchdog(ttl_seconds)
    # The tenant's secrets: one JSON line on stdin, never a file on disk.
    secrets_line = sys.stdin.readline()
    secrets = {str(k): str(v) for k, v in json.loads(secrets_line).items()} if secrets_line.strip() else {}
    os.environ.update(secrets)
    with open(os.path.join(work_dir, "batch.json")) as fh:
        batch = json.load(fh)
    # Started with -I -S: no site module, so none of the interpreter's own
    # site-packages and no .pth processing (that alone costs ~0.35 s under
    # gVisor). The app's code and its dependencies are put on sys.path here.
    for entry in reversed([*batch.get("sys_path", []), *batch.get("site_dirs", [])]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    stop_file = os.path.join(work_dir, "stop")
    signal.signal(signal.SIGALRM, _on_alarm)
    out = open(os.path.join(work_dir, "results.jsonl"), "a")  # noqa: SIM115 (closed at the end; kept open)
    try:
        import tenantq
        from tenantq.registry import REGISTRY, JobContext

        importlib.import_module(batch["app"])
        _ = tenantq  # the app imported it too; kept explicit for clarity
    except BaseException as exc:
        _emit(out, {"id": None, "status": "fatal", "error": f"cannot import app {batch['app']!r}: "
                    + _describe(exc)})
        return 3
    baseline = _address_space()
    runner_pid = os.getpid()
    for job in batch["jobs"]:
        if os.path.exists(stop_file):  # the host asked us to stop between jobs
            break
        _emit(out, {"id": job["id"], "status": "started"})
        started = time.monotonic()
        handler = REGISTRY.get(job["kind"])
        if handler is None:
            _emit(out, {"id": job["id"], "status": "error", "reason": "unknown_kind", "seconds": 0.0,
                        "error": f"unknown kind {job['kind']!r}: no handler registered "
                                 f"(known: {', '.join(REGISTRY.kinds()) or 'none'})"})
            continue
        ctx = JobContext(tenant=batch["tenant"], job_id=job["id"], attempt=job["attempt"], kind=job["kind"],
                         max_attempts=job["max_attempts"], env=dict(secrets))
        record: dict[str, Any]
        try:
            _limit_memory(handler.memory_mb, baseline)
            signal.setitimer(signal.ITIMER_REAL, handler.timeout)
            try:
                result = handler.func(job["payload"], ctx)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            json.dumps(result, allow_nan=False)  # fail here, not on the host, if unstorable
            record = {"id": job["id"], "status": "ok", "result": result}
        except JobTimeout:
            record = {"id": job["id"], "status": "error", "reason": "timeout",
                      "error": f"timeout after {handler.timeout:g} s"}
        except MemoryError as exc:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            detail = _describe(exc).split("\n", 1)[-1]
            record = {"id": job["id"], "status": "error", "reason": "oom",
                      "error": f"oom: exceeded {handler.memory_mb} MiB (MemoryError)\n{detail}"}
        except (TypeError, ValueError) as exc:
            record = {"id": job["id"], "status": "error", "reason": "exception", "error": _describe(exc)}
        except BaseException as exc:
            record = {"id": job["id"], "status": "error", "reason": "exception", "error": _describe(exc)}
        if os.getpid() != runner_pid:
            # a process the handler forked got here (a fork bomb's child whose
            # fork failed): it must never report or run the next job
            os._exit(1)
        record["seconds"] = time.monotonic() - started
        _emit(out, record)
    out.close()
    return 0


if __name__ == "__main__":
    # runner.py WORK_DIR [--ttl SECONDS]
    ttl = float(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[2] == "--ttl" else None
    sys.exit(main(sys.argv[1], ttl))
