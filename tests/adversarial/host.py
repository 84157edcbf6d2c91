"""The host side of the arena: the memory cgroup the worker under attack
runs in, the marker file the attacker knows the path of, and the watcher that
polls the worker's peak RSS and the hostile jobs' attempts; and `Host`, the
process that makes the Sandbox API calls of test_sandbox_api*.py (every call
bounded in time, its own peak RSS checked). host_side.py starts that process,
which imports this module: psycopg and tenantq's worker are imported only where used."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tenantq.store.db import Database

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
CGROUP_LIMIT_BYTES = 1 << 30
KIB, MIB = 1 << 10, 1 << 20
# the host process's own peak RSS may grow at most this much while it is attacked
HOST_RSS_GROWTH_LIMIT = 100 * MIB
# a single host call (file operation, exec with a timeout, delete) that has
# not returned after this long is a hang
HANG_SECONDS = 60.0


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
        from tenantq.testing import wait_until

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
        import psycopg
        from psycopg import sql as pgsql

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


# -- the host process of a Sandbox API test (started by tests/adversarial/host_side.py) --


@dataclass
class Outcome:
    """A bounded host call: its value or error, how long it took, or that it hung."""

    label: str
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    hung: bool = False
    error_chars: int = 160  # how much of the error describe() shows
    show_value: bool = True  # whether describe() shows the value of a call that returned

    @property
    def ok(self) -> bool:
        return not self.hung and self.error is None

    def describe(self) -> str:
        if self.hung:
            return f"HUNG after {self.seconds:.0f} s"
        if self.error is not None:
            return f"{type(self.error).__name__}: {str(self.error)[:self.error_chars]} ({self.seconds:.1f} s)"
        if self.show_value:
            return f"ok: {short(self.value)} ({self.seconds:.1f} s)"
        return f"ok ({self.seconds:.1f} s)"


def short(value: Any, limit: int = 120) -> str:
    if isinstance(value, bytes | str):
        return f"{type(value).__name__}[{len(value)}] {value[:40]!r}"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class Host:
    """The attacked host process (the child of run_host_side): what it saw, its
    sandboxes, its memory. Its report is a JSON file, rewritten at every step."""

    error_chars = 160  # Outcome.describe(): how much of an error
    show_values = True  # Outcome.describe(): the value of a call that returned
    create_seconds: float | None = None  # create() in bounded() (None: called directly)
    gone = "SandboxGone"  # cleanup(): delete() may raise an error whose type name holds this
    strict = True  # bounded(): a BaseException that is not an Exception is a problem

    def __init__(self, report_path: Path) -> None:
        self.report_path = report_path
        self.t0 = time.monotonic()
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.steps: list[str] = []
        self.memory: dict[str, Any] = {}
        self.base_kb: int | None = None
        self.made: list[Any] = []
        self.tags: dict[int, str] = {}
        self.done = False
        self.lock = threading.Lock()

    def run(self, attacks: dict[str, Callable[..., None]], args: dict[str, Any]) -> None:
        """attacks[args["attack"]](self, **args); what it raises is a problem; then cleanup()."""
        try:
            attacks[args.pop("attack")](self, **args)
        except Exception as exc:
            self.problem(f"the host side raised {type(exc).__name__}: {str(exc)[:500]}\n"
                         f"{traceback.format_exc()[-3000:]}")
        finally:
            self.cleanup()
            self.done = True
            self.save()

    def save(self) -> None:
        with self.lock:
            data = {"problems": self.problems, "notes": self.notes, "steps": self.steps,
                    "memory": self.memory, "done": self.done}
            tmp = self.report_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, default=repr))
            tmp.replace(self.report_path)

    def step(self, label: str) -> None:
        self.steps.append(f"{time.monotonic() - self.t0:6.1f}s {label}")
        self.save()

    def problem(self, text: str) -> None:
        self.problems.append(text)
        self.save()

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.save()

    def expect(self, condition: bool, text: str) -> bool:
        if not condition:
            self.problem(text)
        return condition

    # -- memory ----------------------------------------------------------------

    def start_memory(self) -> None:
        """From now on the peak RSS is the attack's: reset VmHWM to VmRSS."""
        self.memory["base_kb"] = status_kb("VmRSS")
        self._reset_peak()

    def _reset_peak(self) -> None:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
        self.base_kb = status_kb("VmRSS")

    def check_memory(self, label: str, limit: int = HOST_RSS_GROWTH_LIMIT) -> None:
        """The peak RSS since the last check (or start_memory), over the RSS
        then, against `limit`; then a new section starts."""
        assert self.base_kb is not None
        growth = (status_kb("VmHWM") - self.base_kb) * KIB
        self.memory[label] = f"{growth / MIB:.1f} MB"
        self.expect(growth <= limit, f"host memory: the host process's peak RSS grew {growth / MIB:.0f} MB "
                                     f"during {label} (limit {limit / MIB:.0f} MB)")
        self._reset_peak()

    # -- sandboxes ---------------------------------------------------------------

    def create(self, role: str, seconds: float | None = None, **kwargs: Any) -> Any:
        """Sandbox.create(**kwargs) with a few defaults and a tag in its metadata;
        bounded by `seconds` (or create_seconds) if set, which raises if it fails."""
        from tenantq import Sandbox

        tag = f"{role}-{uuid.uuid4().hex[:8]}"
        options: dict[str, Any] = {"ttl_seconds": 170, "memory_mb": 256, "timeout_seconds": 30, **kwargs}
        options["metadata"] = {"tqadv": tag, **options.get("metadata", {})}
        seconds = self.create_seconds if seconds is None else seconds
        if seconds is None:
            started = time.monotonic()
            sbx = Sandbox.create(**options)
            took = time.monotonic() - started
        else:
            out = self.bounded(f"create {role}", lambda: Sandbox.create(**options), seconds)
            if not out.ok:
                raise RuntimeError(f"create {role}: {out.describe()}")
            sbx, took = out.value, out.seconds
        self.made.append(sbx)
        self.tags[id(sbx)] = tag
        self.step(f"created {role} ({options.get('driver')}) in {took:.1f} s")
        return sbx

    def info(self, sbx: Any) -> Any:
        """The sandbox's SandboxInfo, found through its metadata (public API only)."""
        from tenantq import Sandbox

        found = Sandbox.list(metadata={"tqadv": self.tags[id(sbx)]})
        return found[0] if found else None

    def cleanup(self) -> None:
        for sbx in self.made:
            out = self.bounded("delete", sbx.delete)
            if out.hung or (out.error is not None and self.gone not in type(out.error).__name__):
                self.problem(f"delete(): {out.describe()}")

    def bounded(self, label: str, fn: Callable[[], Any], seconds: float = HANG_SECONDS) -> Outcome:
        """fn() in a daemon thread; a hang past `seconds` is recorded as a problem."""
        out = Outcome(label, error_chars=self.error_chars, show_value=self.show_values)
        done = threading.Event()

        def call() -> None:
            try:
                out.value = fn()
            except BaseException as exc:
                out.error = exc
            finally:
                done.set()

        started = time.monotonic()
        threading.Thread(target=call, name=f"call-{label}", daemon=True).start()
        if not done.wait(seconds):
            out.hung = True
            self.problem(f"{label}: the host call had not returned after {seconds:.0f} s")
        out.seconds = time.monotonic() - started
        if self.strict and out.error is not None and not isinstance(out.error, Exception):
            self.problem(f"{label}: the host raised {type(out.error).__name__}, not an Exception")
        return out
