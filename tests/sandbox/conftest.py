"""Fixtures for the sandbox suite: real runsc, real bubblewrap, real Postgres.

Every sandbox test runs once per driver (`gvisor`, `process`); a driver that
does not work on this host skips with a reason that says so. Every test gets a
data dir of its own (the worker's TENANTQ_DATA_DIR, the drivers' data_dir),
and after each test `Leftovers` asserts that nothing the test started is left:
no sandbox dir, no runsc container, no tenantq cgroup that was not there
before, no runsc/bwrap process. If something is left it is removed too (so a
failing test does not pollute the host) and the test errors in teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tenantq.sandbox import cgroups
from tenantq.sandbox.cgroups import CgroupBox
from tenantq.sandbox.driver import DriverSandbox, SandboxDriver
from tenantq.sandbox.drivers import bwrap_works, runsc_works
from tenantq.sandbox.drivers.gvisor import GVisorDriver
from tenantq.sandbox.drivers.process import ProcessDriver
from tenantq.sandbox.layout import guest_python
from tenantq.sandbox.spec import SandboxSpec
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.acceptance.helpers import Cli

RUNSC_OK = runsc_works()
BWRAP_OK = bwrap_works()

DRIVERS = [
    pytest.param("gvisor", marks=pytest.mark.skipif(
        not RUNSC_OK, reason="gvisor: runsc is not installed or does not work here "
                             "(runsc_works() is False)")),
    pytest.param("process", marks=pytest.mark.skipif(
        not BWRAP_OK, reason="process: bubblewrap is not installed or does not work here "
                             "(bwrap_works() is False)")),
]

HOSTILE_APP = "tests.apps.hostile"
SLOW_APP = "tests.sandbox.slow_app"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# the controllers tenantq itself creates and removes (cgroups.V1_CONTROLLERS)
MANAGED_CONTROLLERS = ("memory", "pids", "cpu")
# how long a sandbox's cgroups may take to go after its dir is gone
CGROUP_SETTLE_SECONDS = 3.0
WATCH_INTERVAL_SECONDS = 0.005


@pytest.fixture(params=DRIVERS)
def driver_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path


# -- what a test may leave behind ------------------------------------------


def tenantq_cgroup_dirs(controllers: tuple[str, ...] | None = None) -> dict[str, set[str]]:
    """Sandbox ids under <hierarchy>/tenantq/, per cgroup v1 hierarchy (or the v2 root)."""
    out: dict[str, set[str]] = {}
    if not cgroups.is_v1():
        base = CGROUP_ROOT / cgroups.PARENT
        out["unified"] = {p.name for p in base.iterdir() if p.is_dir()} if base.is_dir() else set()
        return out
    for hierarchy in sorted(CGROUP_ROOT.iterdir()):
        if controllers is not None and hierarchy.name not in controllers:
            continue
        base = hierarchy / cgroups.PARENT
        if hierarchy.is_symlink() or not base.is_dir():
            continue
        with contextlib.suppress(OSError):
            out[hierarchy.name] = {p.name for p in base.iterdir() if p.is_dir() and p.name.startswith("tq-")}
    return out


def cgroups_of(sandbox_id: str) -> list[Path]:
    """Every cgroup dir named after this sandbox, in any hierarchy."""
    if not cgroups.is_v1():
        path = CGROUP_ROOT / cgroups.PARENT / sandbox_id
        return [path] if path.exists() else []
    return [h / cgroups.PARENT / sandbox_id for h in sorted(CGROUP_ROOT.iterdir())
            if not h.is_symlink() and (h / cgroups.PARENT / sandbox_id).is_dir()]


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose command line contains `text`."""
    found: list[tuple[int, str]] = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append((int(entry.name), cmdline.strip()))
    return found


def runsc_containers(data_dir: Path) -> list[str]:
    root = data_dir / "runsc"
    if not root.is_dir() or shutil.which("runsc") is None:
        return []
    out = subprocess.run(["runsc", "--root", str(root), "list", "-quiet"], capture_output=True, text=True,
                         timeout=30, check=False)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def sandbox_dirs(data_dir: Path) -> list[Path]:
    """Per-sandbox dirs (<data_dir>/sandboxes/<driver>/<id>) and half-built
    skeletons; the shared rootfs-* skeletons are allowed to stay."""
    base = data_dir / "sandboxes"
    if not base.is_dir():
        return []
    left = [p for p in base.iterdir() if p.name.startswith(".rootfs-")]
    for driver_dir in base.iterdir():
        if driver_dir.is_dir() and not driver_dir.name.startswith(("rootfs-", ".rootfs-")):
            left += list(driver_dir.iterdir())
    return sorted(left)


class Leftovers:
    """Watches the test's data dir for sandbox ids while the test runs (a
    sandbox lives at least as long as its first run, far longer than the
    watch interval), then `check()` looks for anything of those sandboxes
    still on the host. Cgroups of sandboxes this test did not make (another
    process on this host) are left alone."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="sandbox-watch", daemon=True)
        self._watcher.start()

    def _scan(self) -> None:
        for path in sandbox_dirs(self.data_dir):
            if path.name.startswith("tq-"):
                self.seen.add(path.name)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_SECONDS):
            with contextlib.suppress(OSError):
                self._scan()

    def cgroups_left(self, controllers: tuple[str, ...] | None = None) -> dict[str, set[str]]:
        """This test's sandboxes' cgroups still present, per hierarchy."""
        left = {h: ids & self.seen for h, ids in tenantq_cgroup_dirs(controllers).items()}
        return {h: ids for h, ids in left.items() if ids}

    def check(self) -> list[str]:
        """Everything the test left behind (removed as it is found)."""
        self._stop.set()
        self._watcher.join()
        self._scan()
        problems: list[str] = []
        marker = str(self.data_dir)
        # processes: bwrap/runsc (and their gofer/sandbox) name the data dir
        try:
            wait_until(lambda: not processes_mentioning(marker), timeout=15, interval=0.1,
                       message="sandbox processes to exit")
        except TimeoutError:
            procs = processes_mentioning(marker)
            problems.append(f"processes left running: {[c[:160] for _, c in procs]}")
            for pid, _ in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        containers = runsc_containers(self.data_dir)
        if containers:
            problems.append(f"runsc containers left: {containers}")
            for cid in containers:
                for args in (["kill", "--all", cid, "KILL"], ["delete", "--force", cid]):
                    subprocess.run(["runsc", "--root", str(self.data_dir / "runsc"), *args],
                                   capture_output=True, timeout=30, check=False)
        dirs = sandbox_dirs(self.data_dir)
        if dirs:
            problems.append(f"sandbox dirs left: {[str(d.relative_to(self.data_dir)) for d in dirs]}")
            for d in dirs:
                CgroupBox(d.name).remove()
                shutil.rmtree(d, ignore_errors=True)
        # the cgroups tenantq manages (memory, pids, cpu on v1)
        managed = MANAGED_CONTROLLERS if cgroups.is_v1() else None
        try:
            wait_until(lambda: not self.cgroups_left(managed), timeout=CGROUP_SETTLE_SECONDS, interval=0.1,
                       message="the test's tenantq cgroups to go away")
        except TimeoutError:
            left = self.cgroups_left(managed)
            problems.append(f"cgroups left: {left}")
            for sandbox_id in set().union(*left.values()):
                CgroupBox(sandbox_id).remove()
        self.scrub_unmanaged()
        return problems

    def scrub_unmanaged(self) -> None:
        """runsc creates tenantq/<id> in every v1 hierarchy; tenantq removes
        only memory/pids/cpu (test_destroy_leaves_no_cgroup_in_any_hierarchy
        fails on that). Remove this test's empty ones so the suite does not
        pile them up on the host."""
        for hierarchy, ids in self.cgroups_left().items():
            if hierarchy in MANAGED_CONTROLLERS:
                continue
            for sandbox_id in ids:
                path = CGROUP_ROOT / hierarchy / cgroups.PARENT / sandbox_id
                for child in sorted(path.glob("*/"), reverse=True):
                    with contextlib.suppress(OSError):
                        child.rmdir()
                with contextlib.suppress(OSError):
                    path.rmdir()


@pytest.fixture
def leftovers(data_dir: Path) -> Iterator[Leftovers]:
    tracker = Leftovers(data_dir)
    yield tracker
    problems = tracker.check()
    assert not problems, "the test left sandbox state behind:\n" + "\n".join(problems)


# -- drivers used directly ---------------------------------------------------


def make_driver(name: str, data_dir: Path) -> SandboxDriver:
    if name == "gvisor":
        return GVisorDriver(data_dir)
    return ProcessDriver(data_dir)


@pytest.fixture
def driver(driver_name: str, data_dir: Path, leftovers: Leftovers) -> SandboxDriver:
    return make_driver(driver_name, data_dir)


SandboxFactory = Callable[..., DriverSandbox]


@pytest.fixture
def make_sandbox(driver: SandboxDriver) -> Iterator[SandboxFactory]:
    """create(spec) with the guest Python mounted; every sandbox is destroyed
    in teardown (destroy is idempotent), before the leftovers check."""
    created: list[DriverSandbox] = []
    mounts = guest_python().mounts

    def create(**fields: Any) -> DriverSandbox:
        spec = SandboxSpec(**{"tenant": "acme", "memory_mb": 192, "ttl_seconds": 120.0, "mounts": mounts,
                              **fields})
        sandbox = driver.create(spec)
        created.append(sandbox)
        return sandbox

    yield create
    for sandbox in created:
        sandbox.destroy()


@pytest.fixture
def python() -> str:
    """The interpreter inside the sandbox."""
    return guest_python().executable


# -- the CLI against this test's schema and data dir ----------------------------


@pytest.fixture
def sandbox_env(cli_env: dict[str, str], data_dir: Path) -> dict[str, str]:
    env = dict(cli_env)
    env["TENANTQ_DATA_DIR"] = str(data_dir)
    return env


@pytest.fixture
def cli(tenantq_cmd: list[str], sandbox_env: dict[str, str], tmp_path: Path,
        leftovers: Leftovers) -> Iterator[Cli]:
    """`tenantq ...` subprocesses; all killed and reaped in teardown, before
    the leftovers check runs."""
    runner = Cli(tenantq_cmd, sandbox_env, tmp_path)
    try:
        yield runner
    finally:
        runner.cleanup()


@pytest.fixture
def secrets(tmp_path: Path) -> dict[str, dict[str, str]]:
    """Two tenants' secrets, unique per test so a leak is unambiguous."""
    tag = tmp_path.name[-8:].replace("[", "").replace("]", "")
    return {"tenant-a": {"A_TOKEN": f"alpha-secret-{os.getpid()}-{tag}-{time.monotonic_ns()}"},
            "tenant-b": {"B_TOKEN": f"beta-secret-{os.getpid()}-{tag}-{time.monotonic_ns()}"}}


@pytest.fixture
def secrets_file(tmp_path: Path, secrets: dict[str, dict[str, str]]) -> Path:
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps(secrets))
    path.chmod(0o600)
    return path


def worker_args(app: str, driver_name: str, *extra: str) -> list[str]:
    return ["worker", "--app", app, "--sandbox", driver_name, *extra]


def files_containing(root: Path, needles: list[str]) -> list[str]:
    """Regular files under `root` whose bytes contain any of `needles`."""
    hits: list[str] = []
    encoded = [n.encode() for n in needles]
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if any(n in data for n in encoded):
                hits.append(str(path))
    return hits


def pg_data_directory(db: Database) -> str:
    with db.connect() as conn:
        row = conn.execute("SHOW data_directory").fetchone()
    assert row is not None
    return str(next(iter(row.values())))


@pytest.fixture
def harness(leftovers: Leftovers) -> Iterator[Callable[..., Any]]:
    """Make Harnesses (tests/sandbox/warm_harness.py); each one's executor is
    closed after the test, before the leftovers are checked."""
    from tests.sandbox.warm_harness import Harness

    made: list[Harness] = []

    def make(driver: SandboxDriver, policy: Any, **kw: Any) -> Harness:
        h = Harness(driver, policy, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.executor.close()
