"""What a sandbox is made of, and how a run inside it ended."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Literal

NetworkPolicy = Literal["none"]
EndKind = Literal["ok", "exit", "timeout", "oom", "signal", "crashed"]

TAIL_BYTES = 4096


class SnapshotFailed(Exception):
    """Checkpoint or restore does not work (here, or for this app)."""


@dataclass(frozen=True)
class Mount:
    """A host path made visible read-only inside the sandbox."""

    source: str
    target: str


@dataclass(frozen=True)
class SandboxSpec:
    tenant: str
    memory_mb: int = 512
    cpus: float = 1.0
    max_pids: int = 512
    ttl_seconds: float = 300.0
    tmp_mb: int = 64
    # the work dir's quota (a tmpfs of its own; ENOSPC past it)
    work_mb: int = 128
    network: NetworkPolicy = "none"
    mounts: tuple[Mount, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    # a Sandbox API sandbox (sandbox/api.py): a writable layer over the
    # read-only root (its pages are the sandbox's memory, so the memory
    # limit caps it), processes as the sandbox's root without capabilities
    # under gVisor, and the deadline in the host's read-only control dir
    writable_root: bool = False


@dataclass(frozen=True)
class End:
    """How a run ended, classified."""

    kind: EndKind
    exit_code: int | None = None
    signal: int | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    def reason(self) -> str:
        """One line for last_error: `oom: exceeded 256 MiB`, `crashed: SIGSEGV`, ..."""
        if self.kind == "signal" and self.signal is not None:
            name = _signal_name(self.signal)
            if self.signal in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGFPE):
                return f"crashed: {name}"
            return f"killed by signal {self.signal} ({name})"
        if self.kind == "exit":
            return f"crashed: exit code {self.exit_code}" + (f" ({self.detail})" if self.detail else "")
        if self.kind == "timeout":
            return f"timeout {self.detail}".strip()
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


@dataclass(frozen=True)
class ProcessResult:
    exit_code: int
    stdout: str
    stderr: str
    end: End


def classify_exit(returncode: int) -> End:
    """Map a process exit status (negative = signal, 128+N = signal N from a
    container runtime) to an End."""
    if returncode == 0:
        return End("ok", exit_code=0)
    if returncode < 0:
        return End("signal", exit_code=returncode, signal=-returncode)
    if 128 < returncode <= 128 + 64:
        return End("signal", exit_code=returncode, signal=returncode - 128)
    return End("exit", exit_code=returncode)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def tail(data: bytes, limit: int = TAIL_BYTES) -> str:
    return data[-limit:].decode("utf-8", errors="replace")
