"""Acceptance fixtures: `cli` runs tenantq subprocesses against this test's
schema and kills and reaps every process it started in teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.helpers import Cli


@pytest.fixture
def cli(tenantq_cmd: list[str], cli_env: dict[str, str], tmp_path: Path) -> Iterator[Cli]:
    runner = Cli(tenantq_cmd, cli_env, tmp_path)
    try:
        yield runner
    finally:
        runner.cleanup()
