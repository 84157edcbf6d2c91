"""The sandbox driver contract (the drivers, and choosing one: sandbox/drivers/).

A driver turns a SandboxSpec into a DriverSandbox: a private, size-capped work
directory (the host never touches what is in it: docs/security.md, rule
H1), in which commands run with the spec's limits, no network, a read-only
root and only the given mounts; a started command's stdin and stdout are
its control channel. A Firecracker or microsandbox driver implements the
same two protocols.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from tenantq.sandbox.channel import Channel
from tenantq.sandbox.spec import ProcessResult, SandboxSpec

GUEST_WORK_DIR = "/tenantq/work"


class StartedProcess(Protocol):
    """A process started in a sandbox whose stdin and stdout pipes stay
    open: the control channel over which a warm guest runner receives
    batch after batch."""

    channel: Channel

    def write(self, data: bytes) -> bool: ...

    def close_stdin(self) -> None: ...

    def alive(self) -> bool: ...

    def stderr(self) -> str:
        """The last few KiB of its stderr (bounded)."""
        ...

    def stderr_size(self) -> int: ...

    def close(self) -> None: ...

    def wait(self, timeout: float) -> ProcessResult | None:
        """The classified end, or None while it still runs after `timeout`."""
        ...

    def stop(self, detail: str) -> ProcessResult:
        """Kill it for overrunning; the end is a timeout with `detail`."""
        ...


class DriverSandbox(Protocol):
    id: str
    spec: SandboxSpec
    work_dir: Path
    # host dir bound read-only at /tenantq/egress: where a batch's egress proxy socket goes
    egress_dir: Path

    def run(self, argv: list[str], *, timeout: float, stdin: bytes = b"",
            env: dict[str, str] | None = None, self_limiting: bool = False) -> ProcessResult:
        """Run a command inside; `stdin` is how secrets get in without touching disk.

        The command runs as the sandbox's init under `timeout -s KILL <ttl>`,
        so it dies at the sandbox's deadline even if the dispatcher is gone;
        `self_limiting=True` skips that wrapper (one process start less) for
        a command that enforces the deadline itself (the guest runner's --ttl).
        """
        ...

    def start(self, argv: list[str], *, env: dict[str, str] | None = None,
              self_limiting: bool = False, supervisor: bool = False) -> StartedProcess:
        """Start a command and return at once; run() is start + feed + wait.
        `supervisor`: the guest runner, which holds the control channel
        (gVisor runs it as the sandbox's root and jobs as another uid)."""
        ...

    def extend_deadline(self, seconds: float) -> None:
        """Push the TTL (what the reaper reads) to `seconds` from now."""
        ...

    def oom_killed(self) -> bool: ...

    def kill(self) -> None:
        """Kill whatever runs in the sandbox now (its run() then returns)."""
        ...

    def destroy(self) -> None:
        """Remove everything the sandbox left on the host. Idempotent."""
        ...


class SandboxDriver(Protocol):
    name: str
    data_dir: Path
    # can it checkpoint a running sandbox and restore new ones from the image?
    snapshots: bool
    # the uid the guest runner switches each job process to (None: keep its own)
    job_uid: int | None

    def create(self, spec: SandboxSpec) -> DriverSandbox: ...

    def reap(self) -> list[str]:
        """Destroy sandboxes of this driver past their TTL (found by label),
        and stale runtime state. Returns the ids removed."""
        ...


@runtime_checkable
class SnapshotSandbox(Protocol):
    def checkpoint(self, image: Path) -> None:
        """Save what runs to `image` (a new dir) and stop it; SnapshotFailed if not possible."""
        ...


@runtime_checkable
class SnapshotDriver(Protocol):
    def restore(self, spec: SandboxSpec, image: Path,
                argv: list[str]) -> tuple[DriverSandbox, StartedProcess]:
        """A new sandbox whose processes resume from `image`."""
        ...
