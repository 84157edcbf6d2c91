"""What both host-side drivers share: the sandbox directory, files in and
out of the work dir, the cgroup box, TTL bookkeeping, idempotent destroy."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tenantq.sandbox.cgroups import CgroupBox
from tenantq.sandbox.spec import End, ExecResult, SandboxSpec, classify_exit, tail

META_FILE = "sandbox.json"


class HostSandbox:
    """A sandbox's host-side state under <data_dir>/sandboxes/<driver>/<id>."""

    def __init__(self, sandbox_id: str, path: Path, spec: SandboxSpec, driver_name: str) -> None:
        self.id = sandbox_id
        self.path = path
        self.spec = spec
        self.work_dir = path / "work"
        self.egress_dir = path / "egress"
        self.driver_name = driver_name
        self.deadline = time.time() + spec.ttl_seconds
        self.box = CgroupBox(sandbox_id)
        self.destroyed = False
        self._proc: subprocess.Popen[bytes] | None = None
        (path / META_FILE).write_text(json.dumps({
            "id": sandbox_id, "driver": driver_name, "tenant": spec.tenant, "deadline": self.deadline,
            "labels": spec.labels, "created": time.time(), "dispatcher_pid": os.getpid(),
        }))

    def oom_killed(self) -> bool:
        """Did the memory cgroup kill something here for exceeding the limit?"""
        return self.box.oom_killed(self.spec.memory_mb << 20)

    def remaining_ttl(self) -> float:
        return max(0.0, self.deadline - time.time())

    def _safe_name(self, name: str) -> Path:
        target = (self.work_dir / name).resolve()
        if not str(target).startswith(str(self.work_dir.resolve()) + os.sep):
            raise ValueError(f"{name!r} is outside the sandbox's work dir")
        return target

    def put_file(self, name: str, data: bytes) -> None:
        target = self._safe_name(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        with contextlib.suppress(PermissionError):
            st = self.work_dir.stat()
            os.chown(target, st.st_uid, st.st_gid)

    def get_file(self, name: str) -> bytes:
        return self._safe_name(name).read_bytes()

    def start(self, argv: list[str], *, env: dict[str, str] | None = None,
              self_limiting: bool = False) -> Running:
        raise NotImplementedError

    def run(self, argv: list[str], *, timeout: float, stdin: bytes = b"",
            env: dict[str, str] | None = None, self_limiting: bool = False) -> ExecResult:
        """start(), feed stdin and close it, wait up to the budget (killing on
        overrun) and classify the end."""
        running = self.start(argv, env=env, self_limiting=self_limiting)
        running.write(stdin)
        running.close_stdin()
        budget = min(timeout, self.remaining_ttl())
        result = running.wait(budget)
        return result if result is not None else running.stop(f"after {budget:g} s")

    def extend_deadline(self, seconds: float) -> None:
        """A kept-warm sandbox lives on: move the deadline the reaper reads."""
        self.deadline = time.time() + seconds
        meta = read_meta(self.path) or {}
        meta["deadline"] = self.deadline
        (self.path / META_FILE).write_text(json.dumps(meta))

    def _remove_host_state(self) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
        self.box.remove()
        shutil.rmtree(self.path, ignore_errors=True)


class Running:
    """A process started in a sandbox, with its stdin pipe still open (how
    a warm guest runner gets its next batch)."""

    def __init__(self, sandbox: HostSandbox, proc: subprocess.Popen[bytes], out_path: Path, err_path: Path,
                 kill: Callable[[], None]) -> None:
        self.sandbox = sandbox
        self.proc = proc
        self.out_path = out_path
        self.err_path = err_path
        self._kill = kill

    def write(self, data: bytes) -> bool:
        """False when the process no longer reads its stdin (it is gone)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            return False
        return True

    def close_stdin(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stdout(self) -> str:
        return tail(self.out_path.read_bytes()) if self.out_path.exists() else ""

    def wait(self, timeout: float) -> ExecResult | None:
        """The classified end, or None if it still runs after `timeout`."""
        status = wait_exit(self.proc, timeout)
        return None if status is None else self._result(status, classify_exit(status))

    def stop(self, detail: str) -> ExecResult:
        """Kill it (it overran) and return the end as a timeout."""
        self._kill()
        returncode = self.proc.wait(timeout=30)
        return self._result(returncode, End("timeout", exit_code=returncode, detail=detail))

    def _result(self, returncode: int, end: End) -> ExecResult:
        self.close_stdin()
        if end.kind == "signal" and end.signal == 9 and self.sandbox.oom_killed():
            end = End("oom", exit_code=returncode, detail=f"exceeded {self.sandbox.spec.memory_mb} MiB")
        return ExecResult(exit_code=returncode, stdout=tail(self.out_path.read_bytes()),
                          stderr=tail(self.err_path.read_bytes()), end=end)


def read_meta(path: Path) -> dict[str, object] | None:
    try:
        return dict(json.loads((path / META_FILE).read_text()))
    except (OSError, ValueError):
        return None


def owner_alive(meta: dict[str, object] | None) -> bool:
    """Is the dispatcher that created this sandbox still running (on this host)?"""
    if not meta:
        return False
    try:
        os.kill(int(str(meta["dispatcher_pid"])), 0)
    except (KeyError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def expired_dirs(base: Path, *, grace: float = 5.0) -> list[Path]:
    """Sandbox dirs whose TTL (plus grace) has passed, or that lost their
    metadata (a crash between mkdir and writing it)."""
    if not base.is_dir():
        return []
    now = time.time()
    out: list[Path] = []
    for path in base.iterdir():
        if not path.is_dir():
            continue
        meta = read_meta(path)
        deadline = float(str(meta["deadline"])) if meta else path.stat().st_mtime + 3600
        if now > deadline + grace:
            out.append(path)
    return out


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The process's exit status, or None if it still runs after `timeout`.

    Popen.wait(timeout) polls with sleeps of up to 50 ms, which would add
    tens of milliseconds to every batch; a pidfd wakes us the moment the
    process exits.
    """
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # old kernel, or the process is gone
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(max(0.0, timeout) * 1000):
            return None
    finally:
        os.close(fd)
    return proc.wait()
