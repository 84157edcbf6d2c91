"""`sbx.fork_many(n)`: n independent children of a running sandbox (gVisor).

The parent's agent flushes and goes quiet (the channel stops at a frame
boundary), runsc checkpoints the parent (which stops it), and the one
image is restored n + 1 times at once: once back into the parent's own
sandbox (same id, same host dir, a new container), and once into each new
child sandbox. So the parent is paused for the checkpoint plus its own
restore, and the children start from its memory and its files (the
writable root is sandbox memory, so it is in the image). A child shares
nothing with its parent or its siblings afterwards: its own container,
cgroup, host dir and deadline. Each child forgets the parent's commands
(their processes run on in it, unwatched) and reseeds the agent; a
userland process restored in a child must reseed itself (Python's
`random` and hash seed are the parent's: docs/sandbox-api.md).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import TypeVar

from tenantq.sandbox.agent_link import AgentLink
from tenantq.sandbox.boot import agent_argv
from tenantq.sandbox.core import NotSupported, SandboxCore
from tenantq.sandbox.driver import SnapshotDriver, SnapshotSandbox
from tenantq.sandbox.hostside import HostProcess, HostSandbox, unmount_work_dir

HOLD_SECONDS = 30.0
# a fork's children are of the parent's class (the facade's: sandbox/core.py)
S = TypeVar("S", bound=SandboxCore)


@dataclasses.dataclass(frozen=True)
class ForkTimes:
    checkpoint_seconds: float
    parent_paused_seconds: float
    total_seconds: float


def _mount_tmpfs(path: Path, size_mb: int) -> None:
    path.mkdir(mode=0o700)
    options = f"size={size_mb}m,mode=0700"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tenantq-fork", str(path)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        path.rmdir()
        raise OSError(f"cannot mount a tmpfs for the fork's image: {done.stderr.strip()}")


def _unmount(path: Path) -> None:
    unmount_work_dir(path)  # umount -l: the image goes with its tmpfs
    shutil.rmtree(path, ignore_errors=True)


def _answered(link: AgentLink) -> None:
    """A round trip: the restored agent runs (and runsc is done with the image)."""
    link.request({"op": "fs", "fs": "exists", "path": "/"}, HOLD_SECONDS)


def fork_many(parent: S, n: int, ttl: float) -> list[S]:
    """n children of `parent`, of its class (the facade's)."""
    host, driver = parent.host, parent.driver_impl
    if not (driver.snapshots and isinstance(host, SnapshotSandbox) and isinstance(driver, SnapshotDriver)):
        raise NotSupported(f"the {driver.name} driver cannot fork a sandbox (it has no checkpoint/restore; "
                           "use the gvisor driver)")
    argv = agent_argv()  # what restore() is given, as for a template; a restore does not run it
    # the image holds the parent's memory, secrets included: it goes on a
    # tmpfs of its own in the sandbox's host-only dir, never on disk, and is
    # unmounted once every restore has read it
    holder = host.path / f"fork-{uuid.uuid4().hex[:8]}"
    _mount_tmpfs(holder, host.spec.memory_mb * 2 + 64)
    image = holder / "image"
    link = parent.link()
    started = time.monotonic()
    try:
        link.hold(HOLD_SECONDS)
        host.checkpoint(image)
    except BaseException:
        link.release()
        _unmount(holder)
        raise
    checkpointed = time.monotonic()
    children: list[S | BaseException] = [RuntimeError("not restored")] * n
    paused: list[float] = []

    def restore_parent() -> None:
        old = parent.adopt(host.restore(image, argv))  # type: ignore[attr-defined]  # the gvisor driver's
        link.rebind(parent.init_process.channel, forget=False)
        _answered(link)  # restored (runsc has read the image) and running again
        paused.append(time.monotonic() - started)
        if old is not None:
            old.close()  # the checkpointed run's pipes: nobody reads them any more

    def restore_child(index: int) -> None:
        spec = dataclasses.replace(host.spec, ttl_seconds=ttl)
        child_host: HostSandbox | None = None
        try:
            child_host, running = driver.restore(spec, image, argv)  # type: ignore[assignment]
            assert isinstance(child_host, HostSandbox) and isinstance(running, HostProcess)
            child_link = AgentLink(running.channel)
            child_link.ready.set()  # it said so as the parent, before the checkpoint
            child_link.send({"op": "resume", "forget": True})
            _answered(child_link)
            child = type(parent)(child_host, running, child_link, driver, template=parent.template,
                                 metadata=dict(parent.metadata), timeout_seconds=parent.default_timeout)
            child.start_egress(parent.egress)  # its own proxy, the parent's rules
            child.watch()
            children[index] = child
        except BaseException as exc:
            if child_host is not None:
                child_host.destroy()
            children[index] = exc

    threads = [threading.Thread(target=restore_parent, name="tenantq-fork-parent")]
    threads += [threading.Thread(target=restore_child, args=(i,), name=f"tenantq-fork-{i}") for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _unmount(holder)
    if not paused:
        link.fail("the parent could not be restored after its checkpoint")
    failed = [c for c in children if isinstance(c, BaseException)]
    made = [c for c in children if not isinstance(c, BaseException)]
    parent.last_fork = ForkTimes(checkpointed - started, paused[0] if paused else float("nan"),
                                 time.monotonic() - started)
    if failed or not paused:
        for child in made:
            child.delete()
        raise failed[0] if failed else RuntimeError("fork failed: the parent did not come back")
    return made
