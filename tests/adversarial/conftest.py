"""Fixtures for the adversarial suite: each test runs once per driver
(`gvisor`, `process`; a driver that does not work here skips with the
reason), with a data dir, a memory cgroup and a host marker of its own, and
`Leftovers` (tests/sandbox/conftest.py) checking that nothing of its
sandboxes is left on the host afterwards."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenantq import Queue
from tenantq.store.db import Database
from tests.adversarial.harness import ACME, MALLORY, Arena
from tests.adversarial.host import CGROUP_MEMORY, Marker, MemoryCgroup
from tests.sandbox.conftest import DRIVERS, Leftovers


@pytest.fixture(params=DRIVERS)
def driver_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path


@pytest.fixture
def leftovers(data_dir: Path) -> Iterator[Leftovers]:
    tracker = Leftovers(data_dir)
    yield tracker
    problems = tracker.check()
    assert not problems, "the test left sandbox state behind:\n" + "\n".join(problems)


@pytest.fixture
def memory_cgroup() -> Iterator[MemoryCgroup]:
    if not (CGROUP_MEMORY / "memory.limit_in_bytes").exists():
        pytest.skip("the adversarial suite needs the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    if os.geteuid() != 0:
        pytest.skip("the adversarial suite makes memory cgroups: run it as root")
    group = MemoryCgroup()
    try:
        yield group
    finally:
        left = group.remove()
        assert not left, f"processes were still in the test's memory cgroup at teardown: {left}"


@pytest.fixture
def marker(tmp_path: Path) -> Marker:
    return Marker.create(tmp_path)


@pytest.fixture
def secrets(tmp_path: Path) -> dict[str, dict[str, str]]:
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    return {ACME: {"ACME_TOKEN": f"acme-neighbour-secret-{stamp}"},
            MALLORY: {"MALLORY_TOKEN": f"mallory-own-secret-{stamp}"}}


@pytest.fixture
def secrets_file(tmp_path: Path, secrets: dict[str, dict[str, str]]) -> Path:
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps(secrets))
    path.chmod(0o600)
    return path


@pytest.fixture
def arena(driver_name: str, db: Database, queue: Queue, tenantq_cmd: list[str], cli_env: dict[str, str],
          data_dir: Path, tmp_path: Path, memory_cgroup: MemoryCgroup, marker: Marker,
          secrets: dict[str, dict[str, str]], secrets_file: Path, leftovers: Leftovers) -> Iterator[Arena]:
    """The worker under attack, torn down (processes, then the cgroup, then
    the leftovers check) whatever the test did."""
    env = dict(cli_env)
    env["TENANTQ_DATA_DIR"] = str(data_dir)
    ring = Arena(driver=driver_name, db=db, queue=queue, cmd=tenantq_cmd, env=env, tmp_path=tmp_path,
                 cgroup=memory_cgroup, marker=marker, secrets=secrets, secrets_file=secrets_file)
    ring.leftovers = leftovers
    try:
        ring.ensure_baseline()
        yield ring
    finally:
        ring.cleanup()
