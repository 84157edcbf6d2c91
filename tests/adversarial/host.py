"""The host side of the arena: the memory cgroup the worker under attack
runs in, the marker file the attacker knows the path of, and the watcher that
polls the worker's peak RSS and the hostile jobs' attempts."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql as pgsql

from tenantq.store.db import Database
from tenantq.testing import wait_until

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
CGROUP_LIMIT_BYTES = 1 << 30


# -- the memory cgroup the worker under attack lives in ------------------------------


class MemoryCgroup:
    """/sys/fs/cgroup/memory/tenantq-adversarial-<uuid>/ with a 1 GiB limit
    (cgroup v1): a regression takes down this worker, not the machine."""

    def __init__(self) -> None:
        self.path = CGROUP_MEMORY / f"tenantq-adversarial-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(CGROUP_LIMIT_BYTES))

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.procs_file.read_text().split()]
        except OSError:
            return []

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd`, started inside this cgroup (the shell joins, then execs)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.procs_file), *cmd]

    def failcnt(self) -> int:
        try:
            return int((self.path / "memory.failcnt").read_text())
        except (OSError, ValueError):
            return -1

    def remove(self) -> list[str]:
        """Kill what is left, remove the cgroup; what was left, described."""
        left = [describe_host_pid(p) for p in self.pids()]
        with contextlib.suppress(TimeoutError):
            def gone() -> bool:
                for pid in self.pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return not self.pids()

            wait_until(gone, timeout=20, interval=0.05, message="the test cgroup to empty")
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: _rmdir(self.path), timeout=10, interval=0.1, message="the test cgroup to go")
        return left


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def describe_host_pid(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = "?"
    return f"{pid}: {cmd[:160]}"


# -- the host marker ------------------------------------------------------------------


@dataclass
class Marker:
    """A root-owned 0600 file under the test's tmp dir whose path every
    attack is told. Its atime is set an hour before its mtime, so under
    relatime any read of it moves the atime."""

    path: Path
    content: str
    victim: Path
    canary: str
    before: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, tmp_path: Path) -> Marker:
        host = tmp_path / "host"
        host.mkdir(mode=0o700)
        path = host / "marker"
        content = f"tenantq-adversarial-marker-{uuid.uuid4().hex}"
        path.write_text(content)
        path.chmod(0o600)
        os.chown(path, 0, 0)
        st = path.stat()
        os.utime(path, ns=(st.st_mtime_ns - 3600 * 10**9, st.st_mtime_ns))
        victim = tmp_path / "victim"
        victim.mkdir(mode=0o700)
        canary = f"tenantq-adversarial-canary-{uuid.uuid4().hex}"
        (victim / "canary").write_text(canary)
        marker = cls(path=path, content=content, victim=victim, canary=canary)
        marker.before = marker.snapshot()
        return marker

    def snapshot(self) -> dict[str, int]:
        st = os.lstat(self.path)
        return {"uid": st.st_uid, "gid": st.st_gid, "mode": st.st_mode, "size": st.st_size,
                "ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                "atime_ns": st.st_atime_ns, "nlink": st.st_nlink}

    def changes(self) -> list[str]:
        """What happened to the marker and the victim dir (stat before read)."""
        problems: list[str] = []
        try:
            now = self.snapshot()
        except OSError as exc:
            return [f"host marker {self.path} is gone or unreadable: {exc}"]
        for key, value in self.before.items():
            if now[key] != value:
                what = "read (atime moved)" if key == "atime_ns" else "changed"
                problems.append(f"host marker {self.path} was {what}: {key} {value} -> {now[key]}")
        if self.path.read_text() != self.content:
            problems.append(f"host marker {self.path} content changed")
        names = sorted(os.listdir(self.victim)) if self.victim.is_dir() else None
        if names != ["canary"] or (self.victim / "canary").read_text() != self.canary:
            problems.append(f"host victim dir {self.victim} changed: now {names}")
        return problems

    def secrets(self) -> list[str]:
        return [self.content, self.canary]


# -- watching the worker --------------------------------------------------------------


class Watch(threading.Thread):
    """Polls, until stopped: the worker's VmHWM, and every watched job's
    attempts (a job handed out is charged: its attempts never go down)."""

    def __init__(self, db: Database, pid: int) -> None:
        super().__init__(name="adversarial-watch", daemon=True)
        self.db = db
        self.pid = pid
        self.peak_kb = 0
        self.job_ids: list[int] = []
        self.history: dict[int, list[tuple[int, str]]] = {}
        self.errors: list[str] = []
        self._done = threading.Event()
        self._lock = threading.Lock()

    def watch(self, ids: Iterable[int]) -> None:
        with self._lock:
            self.job_ids.extend(ids)

    def read_rss(self) -> None:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_kb = max(self.peak_kb, int(line.split()[1]))
        except (OSError, ValueError, IndexError):
            pass

    def run(self) -> None:
        query = pgsql.SQL("SELECT id, attempts, status FROM {} WHERE id = ANY(%s)").format(
            pgsql.Identifier(self.db.schema, "jobs"))
        try:
            with psycopg.connect(self.db.dsn, autocommit=True) as conn:
                while not self._done.wait(0.01):
                    self.read_rss()
                    with self._lock:
                        ids = list(self.job_ids)
                    if not ids:
                        continue
                    for job_id, attempts, status in conn.execute(query, (ids,)).fetchall():
                        seen = self.history.setdefault(job_id, [])
                        if not seen or seen[-1] != (attempts, status):
                            seen.append((attempts, status))
        except Exception as exc:  # reported, not raised in a thread
            self.errors.append(f"watch failed: {exc!r}")

    def stop(self) -> None:
        self.read_rss()
        self._done.set()
        self.join(timeout=10)
