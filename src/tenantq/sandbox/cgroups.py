"""Cgroups for sandbox limits and for telling an OOM kill apart.

The process driver puts each sandbox in cgroups of its own (memory, pids,
cpu). gVisor manages its own cgroup (`cgroupsPath`) and deletes it on exit,
so tenantq nests it under a parent it owns: the parent's hierarchical peak
usage (v1) or oom_kill count (v2) survives the child and says whether the
sandbox hit its memory limit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PARENT = "tenantq"
V1_CONTROLLERS = ("memory", "pids", "cpu")


def is_v1() -> bool:
    return (ROOT / "memory").is_dir()


def available() -> bool:
    """Can this process create cgroups (root, cgroupfs mounted writable)?"""
    base = ROOT / "memory" if is_v1() else ROOT
    return os.access(base, os.W_OK)


class CgroupBox:
    """Cgroups named tenantq/<id> in every controller tenantq uses."""

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        self.v1 = is_v1()
        if self.v1:
            self.paths = {c: ROOT / c / PARENT / sandbox_id for c in V1_CONTROLLERS}
        else:
            self.paths = {"unified": ROOT / PARENT / sandbox_id}
        self.memory_limit = 0

    @property
    def relative(self) -> str:
        """The path as OCI cgroupsPath wants it (for a child of this box)."""
        return f"/{PARENT}/{self.sandbox_id}"

    def create(self, *, memory_mb: int | None, max_pids: int | None, cpus: float | None,
               only_memory: bool = False) -> None:
        """Make the box and set the given limits. `only_memory`: just the
        memory parent gVisor's own cgroup nests under (for OOM evidence);
        runsc creates the rest itself."""
        if not self.v1:
            with contextlib.suppress(OSError):
                (ROOT / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            parent = ROOT / PARENT
            parent.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        for controller, path in self.paths.items():
            if not only_memory or controller in ("memory", "unified"):
                path.mkdir(parents=True, exist_ok=True)
        if memory_mb is not None:
            self.memory_limit = memory_mb * 1024 * 1024
            limit_file = "memory.limit_in_bytes" if self.v1 else "memory.max"
            self._write("memory", limit_file, str(self.memory_limit))
            if self.v1:
                with contextlib.suppress(OSError):
                    self._write("memory", "memory.memsw.limit_in_bytes", str(self.memory_limit))
            else:
                self._write("memory", "memory.swap.max", "0")
        if max_pids is not None:
            self._write("pids", "pids.max", str(max_pids))
        if cpus is not None:
            period = 100_000
            quota = max(1000, int(cpus * period))
            if self.v1:
                self._write("cpu", "cpu.cfs_period_us", str(period))
                self._write("cpu", "cpu.cfs_quota_us", str(quota))
            else:
                self._write("cpu", "cpu.max", f"{quota} {period}")

    def procs_files(self) -> list[Path]:
        """Where to write a pid to put it in every controller of the box."""
        return [path / "cgroup.procs" for path in self.paths.values()]

    def oom_killed(self, memory_limit: int | None = None) -> bool:
        """Did anything in the box (or a child cgroup) hit the memory limit?"""
        limit = memory_limit or self.memory_limit
        try:
            if self.v1:
                oom = self._read("memory", "memory.oom_control")
                if "oom_kill 1" in oom or any(line == "oom_kill 1" for line in oom.splitlines()):
                    return True
                kills = [int(line.split()[1]) for line in oom.splitlines() if line.startswith("oom_kill ")]
                if kills and kills[0] > 0:
                    return True
                peak = int(self._read("memory", "memory.max_usage_in_bytes"))
                return bool(limit) and peak >= limit - 64 * 1024
            events = self._read("memory", "memory.events")
            return any(line.startswith("oom_kill ") and int(line.split()[1]) > 0
                       for line in events.splitlines())
        except (OSError, ValueError):
            return False

    def oom_kills(self) -> int:
        """How many processes the memory limit killed so far, in the box and
        its child cgroups (runsc puts the container in a child): a counter
        the host reads itself, so an OOM during one command is a change."""
        base = self._controller_path("memory")
        name, key = ("memory.oom_control", "oom_kill") if self.v1 else ("memory.events", "oom_kill")
        total = 0
        for path in [base, *(p for p in base.glob("*") if p.is_dir())] if base.is_dir() else []:
            try:
                lines = (path / name).read_text().splitlines()
            except OSError:
                continue
            total += sum(int(line.split()[1]) for line in lines if line.startswith(key + " "))
        return total

    def kill_all(self) -> None:
        for procs in [p / "cgroup.procs" for p in self.all_paths()]:
            with contextlib.suppress(OSError, ValueError):
                for pid in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(pid), signal.SIGKILL)

    def all_paths(self) -> list[Path]:
        """The box in every hierarchy: runsc creates its cgroupsPath in all
        v1 controllers (blkio, cpuset, freezer, ...), not only ours."""
        if not self.v1:
            return list(self.paths.values())
        boxes = [h / PARENT / self.sandbox_id for h in ROOT.iterdir()]
        return [box for box in boxes if box.is_dir()]

    def remove(self, *, wait_seconds: float = 2.0) -> None:
        """Remove the box (and any child runsc left behind). Idempotent.

        Killed tasks leave a cgroup only once they are reaped, so rmdir is
        retried briefly instead of leaving an empty box behind."""
        self.kill_all()
        deadline = time.monotonic() + wait_seconds
        while True:
            left = [p for p in self.all_paths() if not _rmtree_cgroup(p)]
            if not left or time.monotonic() >= deadline:
                return
            self.kill_all()
            time.sleep(0.01)

    def _controller_path(self, controller: str) -> Path:
        return self.paths[controller] if self.v1 else self.paths["unified"]

    def _write(self, controller: str, name: str, value: str) -> None:
        (self._controller_path(controller) / name).write_text(value)

    def _read(self, controller: str, name: str) -> str:
        return (self._controller_path(controller) / name).read_text()


def _rmtree_cgroup(path: Path) -> bool:
    """cgroup dirs can only be removed bottom-up with rmdir (no files
    inside); True when the path is gone."""
    if not path.is_dir():
        return True
    for child in path.iterdir():
        if child.is_dir():
            _rmtree_cgroup(child)
    try:
        path.rmdir()
    except OSError:
        return False
    return True


def stale_boxes() -> list[str]:
    """Ids of tenantq cgroup boxes present on this host."""
    base = ROOT / "memory" / PARENT if is_v1() else ROOT / PARENT
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if p.is_dir())
