"""One job in its own process (forked by the batch supervisor, guest/supervisor.py).
Stdlib only.

The process holds nothing of the control channel: its fds are /dev/null,
a pipe for its output (fd 1 and 2, drained by the supervisor) and a pipe
for its one result frame (fd 3). Under gVisor it runs as an unprivileged
uid that differs from the supervisor's, so it cannot signal it, reopen its
fds through /proc, or read its memory (docs/security.md, rule C1). The
handler's timeout is an interval timer, its memory an RLIMIT_AS; the
supervisor enforces both again from outside.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys
import traceback
from types import FrameType
from typing import Any

from tenantq.guest.protocol import (
    MAX_CALL_REQUEST_BYTES,
    MAX_JSON_DEPTH,
    MAX_RESULT_BYTES,
    FrameError,
    FrameFile,
    encode,
    json_depth,
    write_all,
)

TRACEBACK_LINES = 12
# the batch's host-function socket (dispatch/executors/host_calls.py), bound read-only by the host
HOST_FUNCTIONS_SOCKET = "/tenantq/egress/hostfn.sock"
RESULT_FD = 3
COMMAND_FD = 4  # further jobs, for a handler with process="batch"
WORK_DIR = "/tenantq/work"


class JobTimeout(BaseException):
    """Raised in the handler when its timeout fires (BaseException, so a
    handler's `except Exception` cannot swallow it)."""


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise JobTimeout()


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


def drop_privileges(uid: int | None) -> None:
    """Become the job's uid (gVisor: the supervisor is the sandbox's root);
    every capability goes with the uid change. First a System V / POSIX
    message-queue namespace of the job's own (CAP_SYS_ADMIN, held by the
    supervisor for this): whatever IPC objects the job makes die with its
    process (rule P1; gVisor cannot enumerate them to remove them)."""
    if uid is None or os.getuid() == uid:
        return
    from tenantq.guest.scratch import new_ipc_namespace

    new_ipc_namespace()
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def reseed() -> None:
    """A restored image and a fork both duplicate the parent's PRNG states:
    give this job its own (os.urandom differs per restore and per fork)."""
    # only what the parent imported: a module imported later by the job
    # seeds itself (and importing random here would cost milliseconds per job)
    random = sys.modules.get("random")
    if random is not None:
        random.seed()
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile._name_sequence = None  # type: ignore[attr-defined]


def run_job(tenant: str, job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Run the handler; the outcome record (without seq) the supervisor relays."""
    from tenantq.registry import REGISTRY, JobContext

    handler = REGISTRY.get(str(job.get("kind")))
    if handler is None:
        return {"ok": False, "reason": "unknown_kind",
                "error": f"unknown kind {job.get('kind')!r}: no handler registered "
                         f"(known: {', '.join(REGISTRY.kinds()) or 'none'})"}
    meta = job.get("meta")
    actor = job.get("actor")
    ctx = JobContext(tenant=tenant, job_id=int(job["id"]), attempt=int(job["attempt"]), kind=handler.kind,
                     max_attempts=int(job["max_attempts"]), env=dict(env),
                     actor=actor if isinstance(actor, str) else None,
                     meta=meta if isinstance(meta, dict) else {},
                     caller=call_host if handler.host_functions else None, sandboxed=True)
    signal.signal(signal.SIGALRM, _on_alarm)
    limit = _address_space() + handler.memory_mb * 1024 * 1024
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        signal.setitimer(signal.ITIMER_REAL, handler.timeout)
        try:
            result = handler.call(job["payload"], ctx)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        return {"ok": True, "result": result}
    except JobTimeout:
        return {"ok": False, "reason": "timeout", "error": f"timeout after {handler.timeout:g} s"}
    except MemoryError as exc:
        detail = describe(exc).split("\n", 1)[-1]
        return {"ok": False, "reason": "oom",
                "error": f"oom: exceeded {handler.memory_mb} MiB (MemoryError)\n{detail}"}
    except BaseException as exc:
        return {"ok": False, "reason": "exception", "error": describe(exc)}


def call_host(name: str, args: dict[str, Any]) -> Any:
    """ctx.call in a sandbox: one request frame on a fresh connection to the
    host's socket, one reply frame. The host checks everything; this only
    turns the reply into a value or a HostFunctionError."""
    import socket

    from tenantq.errors import HostFunctionError

    try:
        body = json.dumps({"name": name, "args": args}, allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise HostFunctionError(f"ctx.call({name!r}): args are not JSON: {str(exc)[:200]}") from None
    if len(body) > MAX_CALL_REQUEST_BYTES:
        raise HostFunctionError(f"ctx.call({name!r}): a request of {len(body)} bytes exceeds "
                                f"{MAX_CALL_REQUEST_BYTES} (the host refuses it)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.connect(HOST_FUNCTIONS_SOCKET)
            data = memoryview(b"%010d\n" % len(body) + body)
            while data:  # MSG_NOSIGNAL: a host that hung up is an error here, not a SIGPIPE
                data = data[conn.send(data, socket.MSG_NOSIGNAL):]
            reply = FrameFile(conn.fileno()).read()
        except (OSError, FrameError) as exc:
            raise HostFunctionError(f"ctx.call({name!r}): the host's function socket: {exc}") from None
    if reply is None:
        raise HostFunctionError(f"ctx.call({name!r}): the host closed the connection without a reply")
    if reply.get("ok") is True:
        return reply.get("result")
    raise HostFunctionError(str(reply.get("error", "failed"))[:2000])


def job_main(tenant: str, job: dict[str, Any], env: dict[str, str], job_uid: int | None,
             command_fd: int | None = None) -> None:
    """The job process's whole life: never returns. With `command_fd` (a
    handler with process="batch") it then runs the further jobs of its kind
    that the supervisor sends on that pipe, one result frame each, until EOF."""
    me = os.getpid()
    code = 0
    try:
        drop_privileges(job_uid)
        from tenantq.guest import scratch

        scratch.clean()
        reseed()
        os.chdir(WORK_DIR)
        commands = FrameFile(command_fd) if command_fd is not None else None
        while True:
            outcome = run_job(tenant, job, env)
            if os.getpid() != me:
                # a process the handler forked got here: it must never report
                os._exit(1)
            write_all(RESULT_FD, encode(_storable(outcome)))
            if commands is None:
                break
            following = commands.read()
            if following is None:
                break
            job = following
    except BaseException:
        code = 70
        with contextlib.suppress(BaseException):
            traceback.print_exc()  # into the job's own output, whose tail comes back with the failure
    finally:
        os._exit(code)


def _storable(outcome: dict[str, Any]) -> dict[str, Any]:
    """The outcome, or a failure saying why its result cannot be stored:
    fail here, in the tenant's sandbox, not on the host."""
    if not outcome.get("ok"):
        return outcome
    result = outcome.get("result")
    try:
        size = len(json.dumps(result, allow_nan=False).encode())
    except (TypeError, ValueError, RecursionError) as exc:
        problem = f"result is not JSON-serialisable: {str(exc)[:200]}"
    else:
        if size > MAX_RESULT_BYTES:
            problem = f"result is {size} bytes of JSON; the limit is {MAX_RESULT_BYTES}"
        elif json_depth(result) > MAX_JSON_DEPTH - 1:
            problem = f"result is nested more than {MAX_JSON_DEPTH - 1} levels deep"
        else:
            return outcome
    return {"ok": False, "reason": "unstorable", "error": problem}


def load_result(data: bytes) -> dict[str, Any]:
    """The supervisor's view of what a job process wrote on its result pipe."""
    from tenantq.guest.protocol import HEADER_BYTES, decode_body, parse_header

    length = parse_header(data[:HEADER_BYTES])
    if len(data) != HEADER_BYTES + length:
        raise FrameError("the result frame is truncated or has trailing bytes")
    return decode_body(data[HEADER_BYTES:])


