"""The batch supervisor: the process the warm parent forks per batch. Stdlib only.

It reads the tenant's secrets (so the warm parent never holds them), says
`batch_ready`, then takes the host's jobs one at a time from the control
channel: for each it forks a fresh job process (guest/jobs.py) from its own
pristine memory, relays the job's one result frame (bounded while reading),
drains the job's output into a small tail, enforces the handler's timeout
from outside, kills every process the job left behind, and writes one
`job_end` to the host. Only this process and the warm parent hold the
channel; no job process ever does (docs/security.md, rules C1 and C2).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from dataclasses import dataclass
from typing import Any

from tenantq.guest import jobs
from tenantq.guest.protocol import (
    HEADER_BYTES,
    MAX_ERROR_CHARS,
    MAX_FRAME_BYTES,
    OUTPUT_TAIL_BYTES,
    FrameError,
    FrameFile,
    encode,
    parse_header,
    write_all,
)

EOF_EXIT = 75  # the host's end of the channel closed: the dispatcher is gone
PROTOCOL_EXIT = 76
# past the handler's own timer, how long before the supervisor kills the job
JOB_GRACE_SECONDS = 1.0
DEFAULT_TIMEOUT = 60.0
READ_CHUNK = 1 << 16
KILL_ROUNDS_SECONDS = 2.0


def say(record: dict[str, Any]) -> None:
    write_all(1, encode(record))


def set_no_dump() -> None:
    """Non-dumpable: a process of the same uid cannot ptrace this one, read
    its memory, or (on Linux) reopen its fds via /proc (rule C1)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE


def _set_subreaper() -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def kill_others() -> bool:
    """Kill every process this one may signal but init (the warm parent) and
    itself, and reap them; True when none is left."""
    deadline = time.monotonic() + KILL_ROUNDS_SECONDS
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            gone = True
        else:
            gone = False
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if gone:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


def reap(pid: int) -> int | None:
    """Reap every exited child (the runner is the sandbox's init and the
    supervisor a subreaper: orphans are theirs too); return `pid`'s wait
    status once it has exited."""
    found: int | None = None
    while True:
        try:
            child, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if child == 0:
            return found
        if child == pid:
            found = status


def _signal_text(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    if number in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGFPE):
        return f"crashed: {name}"
    return f"killed by signal {number} ({name})"


@dataclass
class JobProcess:
    """A job's process and the supervisor's ends of its pipes."""

    kind: str
    pid: int
    result_r: int
    out_r: int
    command_w: int  # -1 unless the handler has process="batch"
    exited: bool = False


def _wanted(result: bytearray) -> int:
    """Bytes that complete the result frame (the header first): a job's
    bytes beyond its one frame are never read into this job's result."""
    if len(result) < HEADER_BYTES:
        return HEADER_BYTES - len(result)
    try:
        return max(1, HEADER_BYTES + parse_header(bytes(result[:HEADER_BYTES])) - len(result))
    except FrameError:
        return READ_CHUNK  # broken: read on, the frame check reports it


def _complete(result: bytearray) -> bool:
    if len(result) < HEADER_BYTES:
        return False
    try:
        return len(result) >= HEADER_BYTES + parse_header(bytes(result[:HEADER_BYTES]))
    except FrameError:
        return False


class Supervisor:
    def __init__(self, stdin: FrameFile, command: dict[str, Any], wake_r: int) -> None:
        self.shared: JobProcess | None = None
        self.stdin = stdin
        self.tenant = str(command.get("tenant", ""))
        self.job_uid = command.get("job_uid")
        self.deadline = time.monotonic() + float(command.get("ttl", 60))
        self.wake_r = wake_r
        self.seq: object = None  # the host's number of the job in flight

    def serve(self) -> int:
        secrets = self.stdin.read()
        if secrets is None:
            return EOF_EXIT
        env = {str(k): str(v) for k, v in secrets.items()}
        os.environ.update(env)
        set_no_dump()
        _set_subreaper()
        from tenantq.guest import egress

        egress.install()
        say({"status": "batch_ready"})
        while True:
            try:
                command = self.stdin.read()
            except FrameError:
                return PROTOCOL_EXIT
            if command is None:
                return EOF_EXIT
            if command.get("op") == "end":
                return 0
            if command.get("op") == "cancel":
                continue  # for a job that ended before the request arrived
            if command.get("op") != "job" or not isinstance(command.get("job"), dict):
                return PROTOCOL_EXIT
            self.seq = command.get("seq")
            outcome = self.run(command["job"], env)
            if outcome is None:
                return EOF_EXIT
            say({"status": "job_end", "seq": command.get("seq"), **outcome})

    def run(self, job: dict[str, Any], env: dict[str, str]) -> dict[str, Any] | None:
        """One job in a fresh process (or, for a handler with process="batch",
        in the process the previous job of its kind ran in); its outcome, or
        None when the host is gone."""
        from tenantq.registry import REGISTRY

        kind = str(job.get("kind"))
        handler = REGISTRY.get(kind)
        timeout = handler.timeout if handler is not None else DEFAULT_TIMEOUT
        shared = handler is not None and handler.process == "batch"
        if self.shared is not None and (not shared or self.shared.kind != kind):
            self.retire_shared()
        if self.shared is not None:
            try:
                write_all(self.shared.command_w, encode(job))
            except OSError:
                self.retire_shared()
        if self.shared is None:
            self.shared = self._start(job, env, kind, shared)
        current = self.shared
        outcome = self._follow(current.pid, current.result_r, current.out_r, timeout)
        reusable = outcome is not None and outcome.pop("reusable", True)
        if not (shared and reusable and not current.exited):
            self.retire_shared()  # per job, or after a failure of its process
        return outcome

    def _start(self, job: dict[str, Any], env: dict[str, str], kind: str, shared: bool) -> JobProcess:
        result_r, result_w = os.pipe()
        out_r, out_w = os.pipe()
        command_r, command_w = os.pipe() if shared else (-1, -1)
        pid = os.fork()
        if pid == 0:
            fd = self._become_job(result_w, out_w, command_r if shared else None)
            jobs.job_main(self.tenant, job, env, self.job_uid, fd)
        for fd in (result_w, out_w, command_r):
            if fd >= 0:
                os.close(fd)
        return JobProcess(kind, pid, result_r, out_r, command_w)

    def retire_shared(self) -> None:
        """End the job process and everything it left (rule C2)."""
        current, self.shared = self.shared, None
        if current is not None:
            for fd in (current.result_r, current.out_r, current.command_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        kill_others()

    def _become_job(self, result_w: int, out_w: int, command_r: int | None) -> int | None:
        """In the forked child: keep only /dev/null, the output pipe, the
        result pipe (and for process="batch" a pipe of further jobs); never
        the control channel (rule C1)."""
        import fcntl

        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        targets = {0: os.open(os.devnull, os.O_RDWR), 1: out_w, 2: out_w, jobs.RESULT_FD: result_w}
        if command_r is not None:
            targets[jobs.COMMAND_FD] = command_r
        # first out of the way (above every target), then into place
        high = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for target, fd in targets.items()}
        for target, fd in high.items():
            os.dup2(fd, target)
        os.closerange(max(targets) + 1, 65536)
        return jobs.COMMAND_FD if command_r is not None else None

    def _follow(self, pid: int, result_r: int, out_r: int, timeout: float) -> dict[str, Any] | None:
        """Wait for the job's one result frame (or its end); bounded reads."""
        result = bytearray()
        tail = bytearray()
        printed = 0
        limit = HEADER_BYTES + MAX_FRAME_BYTES
        deadline = min(time.monotonic() + timeout + JOB_GRACE_SECONDS, self.deadline)
        status: int | None = None
        overflow = timed_out = cancelled = False
        open_fds = {result_r, out_r}
        while not _complete(result):
            status = reap(pid)
            if status is not None:
                # the job is gone: whatever it (or a leftover child) still
                # writes is not waited for
                assert self.shared is not None
                self.shared.exited = True
                self._drain(result_r, result, limit, out_r, tail)
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            readable, _, _ = select.select([*open_fds, self.wake_r, 0], [], [], remaining)
            if 0 in readable:
                # mid-job, the host sends only `cancel` for this job; EOF or
                # anything else: the host is gone
                try:
                    command = self.stdin.read()
                except FrameError:
                    return None
                if command is None or command.get("op") != "cancel":
                    return None
                if command.get("seq") == self.seq:
                    cancelled = True
                    break
                continue
            if self.wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            if result_r in readable:
                chunk = os.read(result_r, min(READ_CHUNK, _wanted(result)))
                if not chunk:
                    open_fds.discard(result_r)
                result += chunk
                if len(result) > limit:
                    overflow = True
                    break
            if out_r in readable:
                chunk = os.read(out_r, READ_CHUNK)
                if not chunk:
                    open_fds.discard(out_r)
                printed += len(chunk)
                tail = (tail + chunk)[-OUTPUT_TAIL_BYTES:]
        if cancelled:
            # run() retires the job's process (and all it started) before the host hears of it
            return {"ok": False, "reason": "cancelled", "error": "cancelled while running", "reusable": False}
        outcome = self._outcome(bytes(result), status, overflow, timed_out, timeout)
        if not _complete(result) or status is not None:
            outcome["reusable"] = False
        if tail and not outcome.get("ok"):
            text = tail.decode("utf-8", "replace")
            note = f"\n--- output ({printed} bytes; last {len(tail)}) ---\n{text}"
            outcome["error"] = (str(outcome.get("error", ""))[: MAX_ERROR_CHARS - len(note)] + note)
        return outcome

    @staticmethod
    def _drain(result_r: int, result: bytearray, limit: int, out_r: int, tail: bytearray) -> None:
        for fd in (result_r, out_r):
            os.set_blocking(fd, False)
        with contextlib.suppress(BlockingIOError, OSError):
            while len(result) <= limit:
                chunk = os.read(result_r, READ_CHUNK)
                if not chunk:
                    break
                result += chunk

    @staticmethod
    def _outcome(result: bytes, status: int | None, overflow: bool, timed_out: bool,
                 timeout: float) -> dict[str, Any]:
        if overflow:
            return {"ok": False, "reason": "unstorable",
                    "error": f"result is larger than {MAX_FRAME_BYTES} bytes of JSON"}
        if result:
            try:
                record = jobs.load_result(result)
            except FrameError as exc:
                return {"ok": False, "reason": "crashed", "error": f"the job wrote a broken result: {exc}"}
            if record.get("ok") is True:
                return {"ok": True, "result": record.get("result")}
            return {"ok": False, "reason": str(record.get("reason", "exception")),
                    "error": str(record.get("error", "failed"))[:MAX_ERROR_CHARS]}
        if timed_out:
            return {"ok": False, "reason": "timeout", "error": f"timeout after {timeout:g} s"}
        if status is not None and os.WIFSIGNALED(status):
            return {"ok": False, "reason": "crashed", "error": _signal_text(os.WTERMSIG(status))}
        code = os.waitstatus_to_exitcode(status) if status is not None else -1
        return {"ok": False, "reason": "crashed",
                "error": f"crashed: exit code {code} (the job's process exited without a result)"}
