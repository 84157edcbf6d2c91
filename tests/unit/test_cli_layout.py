"""The command line is one package, `tenantq.cli` (issue "house"): a
module per noun, each under 400 lines, nothing of it left at the package
root; its commands importable from the package; `tenantq --help` loads
neither the queue nor psycopg; the worker's defaults are written once (the
TENANTQ_WORKER_* settings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest

from tenantq.dispatch.config import WorkerConfig
from tenantq.settings import DEFAULT_WORKER_INTERACTIVE_SHARE, Settings

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "tenantq"


def test_the_cli_is_one_package_of_small_modules() -> None:
    assert not list(PACKAGE.glob("cli*.py")), "a cli*.py file is left at the package root"
    modules = {p.name for p in (PACKAGE / "cli").glob("*.py")}
    assert {"__init__.py", "__main__.py", "_common.py", "jobs.py", "worker.py", "tenants.py", "schedules.py",
            "sandboxes.py", "templates.py", "admin.py"} <= modules
    for path in (PACKAGE / "cli").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 400, path.name


def test_the_commands_are_importable_from_the_package() -> None:
    from tenantq.cli import cancel, cli, dead, jobs, main, worker

    assert isinstance(worker, click.Command) and worker.name == "worker"
    assert cli.commands["worker"] is worker and cli.commands["cancel"] is cancel
    assert isinstance(dead, click.Group) and isinstance(jobs, click.Group) and callable(main)


def test_the_help_texts_agree_with_the_store() -> None:
    from tenantq.cli import _common
    from tenantq.store import search

    assert _common.JOB_STATUSES == search.STATUSES
    assert (_common.DEFAULT_LIMIT, _common.MAX_LIMIT) == (search.DEFAULT_LIMIT, search.MAX_LIMIT)


def test_help_and_status_stay_light() -> None:
    """The queue (and psycopg) are imported inside the commands that use them."""
    code = ("import sys; from tenantq.cli import cli; "
            "print(sorted(m for m in ('psycopg', 'tenantq.queue', 'tenantq.dispatch.worker', 'pydantic') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_worker_defaults_are_the_settings() -> None:
    fields = Settings.model_fields
    config = WorkerConfig()
    assert config.concurrency == fields["worker_concurrency"].default
    assert config.batch_size == fields["worker_batch_size"].default
    assert config.lease_seconds == fields["worker_lease_seconds"].default
    assert config.poll_seconds == fields["worker_poll_seconds"].default
    assert config.backoff.base_seconds == fields["worker_backoff_base"].default
    assert config.backoff.cap_seconds == fields["worker_backoff_cap"].default
    assert config.fair_by.value == fields["worker_fair_by"].default
    assert config.interactive_share == fields["worker_interactive_share"].default
    from tenantq.fairness.slots import DEFAULT_INTERACTIVE_SHARE

    assert DEFAULT_INTERACTIVE_SHARE == DEFAULT_WORKER_INTERACTIVE_SHARE


def _worker_params(*args: str) -> dict[str, object]:
    from tenantq.cli import worker

    with worker.make_context("worker", ["--app", "myapp.jobs", *args]) as ctx:
        return dict(ctx.params)


def test_a_worker_setting_changes_the_options_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TENANTQ_WORKER_CONCURRENCY", "TENANTQ_WORKER_SANDBOX", "TENANTQ_WORKER_KEEP_WARM"):
        monkeypatch.delenv(name, raising=False)
    assert _worker_params()["concurrency"] == 4
    monkeypatch.setenv("TENANTQ_WORKER_CONCURRENCY", "12")
    monkeypatch.setenv("TENANTQ_WORKER_SANDBOX", "inline")
    monkeypatch.setenv("TENANTQ_WORKER_KEEP_WARM", "30")
    params = _worker_params()
    assert (params["concurrency"], params["sandbox"], params["keep_warm"]) == (12, "inline", 30.0)
    assert _worker_params("--concurrency", "2")["concurrency"] == 2  # the option wins


def test_the_help_shows_the_settings_default_and_variable() -> None:
    from tenantq.cli import cli

    text = " ".join(cli.commands["worker"].get_help(click.Context(cli.commands["worker"])).split())
    assert "env var: TENANTQ_WORKER_CONCURRENCY; default: 4;" in text, text


def test_a_worker_setting_out_of_range_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"TENANTQ_WORKER_CONCURRENCY": "0", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "tenantq.cli", "worker", "--app", "myapp.jobs"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: TENANTQ_WORKER_CONCURRENCY:"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
