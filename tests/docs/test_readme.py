"""Every code block in README.md runs as written (river's runnable examples).

Python blocks whose first line is `# PATH.py: ...` are files: they are
written to PATH in a fresh project directory. Shell blocks run there, line
by line, with the installed `tenantq` and `python` on PATH, against a
schema of this test's own. The first block (`./run demo`, `./run test`) is
the README's two commands: `./run test` is what CI runs (.ci/run), and the
demo has its own test (tests/acceptance_sandboxed/test_demo.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tenantq.sandbox.drivers import bwrap_works, runsc_works
from tenantq.store.db import Database
from tests.conftest import ROOT

FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
FILE_HEADER = re.compile(r"^# ([\w./-]+\.py)\b")
SANDBOXES = runsc_works() or bwrap_works()


def blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer((ROOT / "README.md").read_text())]


def test_the_readme_has_only_blocks_this_test_knows_how_to_run() -> None:
    found = blocks()
    assert found[0][1].startswith("./run demo") and "./run test" in found[0][1]
    for language, _ in found:
        assert language in ("python", "bash"), f"a {language} block: teach this test to run it"


@pytest.mark.skipif(not SANDBOXES, reason="the README's worker runs sandboxed: neither runsc nor bwrap works")
def test_every_readme_block_runs_as_written(tmp_path: Path, db: Database) -> None:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "TENANTQ_DATABASE_URL": db.dsn, "TENANTQ_SCHEMA": db.schema,
           "TENANTQ_DATA_DIR": str(tmp_path / "data"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(tmp_path)}
    env.pop("PYTEST_ADDOPTS", None)
    ran: list[str] = []
    for language, text in blocks()[1:]:
        header = FILE_HEADER.match(text)
        if language == "python" and header:
            path = tmp_path / header.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.parent != tmp_path:
                (path.parent / "__init__.py").touch()
            path.write_text(text)
            continue
        if language == "python":
            lines = [text]
            command = [sys.executable, "-c"]
        else:
            lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
            command = ["bash", "-euo", "pipefail", "-c"]
        for line in lines:
            done = subprocess.run([*command, line], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=300)
            output = done.stdout[-2000:] + done.stderr[-3000:]
            assert done.returncode == 0, f"README line failed: {line}\n{output}"
            ran.append(line)
    assert any(line.startswith("tenantq worker") for line in ran), ran
    assert any("pytest" in line for line in ran), ran


def test_the_readme_names_every_benchmark() -> None:
    """`./run bench NAME`: the README's list is the runner's (bench/__main__.py)."""
    from bench.__main__ import BENCHMARKS

    readme = (ROOT / "README.md").read_text()
    section = readme.split("`./run bench [NAME ...]`", 1)[1].split("`./run fuzz", 1)[0]
    listed = set(re.findall(r"`([a-z-]+)`", section.split("):", 1)[1]))
    assert listed == set(BENCHMARKS), f"README lists {sorted(listed)}; bench has {sorted(BENCHMARKS)}"
