"""Fixtures for the Sandbox API suite: each test runs per driver (real
runsc, real bubblewrap; skipped with a reason where one does not work), in a
data dir of its own, and the sandbox suite's leftovers check runs after it
(no sandbox dir, container, cgroup or process may be left)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sandbox.conftest import DRIVERS, Leftovers

__all__ = ["DRIVERS"]


@pytest.fixture(params=DRIVERS)
def driver_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "data"
    path.mkdir()
    monkeypatch.setenv("TENANTQ_DATA_DIR", str(path))
    # no ready pool unless a test asks for one (test_pool.py): it would boot
    # sandboxes in the background that outlive the test
    monkeypatch.setenv("TENANTQ_POOL_SIZE", "0")
    leftovers = Leftovers(path)
    yield path
    problems = leftovers.check()
    assert not problems, "\n".join(problems)
