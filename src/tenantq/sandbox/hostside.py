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
        self.driver_name = driver_name
        self.deadline = time.time() + spec.ttl_seconds
        self.box = CgroupBox(sandbox_id)
        self.destroyed = False
        self._proc: subprocess.Popen[bytes] | None = None
        (path / META_FILE).write_text(json.dumps({
            "id": sandbox_id, "driver": driver_name, "tenant": spec.tenant, "deadline": self.deadline,
            "labels": spec.labels, "created": time.time(), "dispatcher_pid": os.getpid(),
        }))

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

    def _supervise(self, proc: subprocess.Popen[bytes], stdin: bytes, timeout: float,
                   kill: Callable[[], None], out_path: Path, err_path: Path) -> ExecResult:
        """Feed stdin, wait up to the budget (killing on overrun) and classify
        the end: the part of run() every host-side driver shares."""
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(stdin)
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        budget = min(timeout, self.remaining_ttl())
        status = wait_exit(proc, budget)
        if status is None:
            kill()
            returncode = proc.wait(timeout=30)
            end = End("timeout", exit_code=returncode, detail=f"after {budget:g} s")
        else:
            returncode = status
            end = classify_exit(returncode)
            if end.kind == "signal" and end.signal == 9 and self.box.oom_killed(self.spec.memory_mb << 20):
                end = End("oom", exit_code=returncode, detail=f"exceeded {self.spec.memory_mb} MiB")
        return ExecResult(exit_code=returncode, stdout=tail(out_path.read_bytes()),
                          stderr=tail(err_path.read_bytes()), end=end)

    def _remove_host_state(self) -> None:
        self.box.remove()
        shutil.rmtree(self.path, ignore_errors=True)


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
