"""`tenantq template build|list|rm` for the queue's checkpoints and the
worker's warm-start flags, as subprocesses against this test's data dir
(the Sandbox API's named templates: tests/sandbox_api/test_templates.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenantq import Queue
from tests.acceptance.helpers import Cli
from tests.sandbox.conftest import RUNSC_OK, worker_args

WARM_APP = "tests.apps.warm"


@pytest.mark.skipif(not RUNSC_OK, reason="gvisor: runsc is not installed or does not work here "
                                         "(templates need checkpoint/restore)")
def test_build_list_rm(cli: Cli, queue: Queue, data_dir: Path) -> None:
    assert cli.ok("template", "list").strip().endswith("no checkpoints")
    built = cli.ok("template", "build", "--app", WARM_APP)
    assert built.startswith("built template ") and "(gvisor)" in built, built
    key = built.split()[2]
    assert "is up to date" in cli.ok("template", "build", "--app", WARM_APP)
    (row,) = cli.json("template", "list")["checkpoints"]
    assert row["key"] == key and row["of"] == WARM_APP and row["kind"] == "checkpoint"
    assert row["size_mb"] > 0

    # a worker restores from it instead of building another
    job = queue.enqueue("acme", "warm.state")
    res = cli.run(*worker_args(WARM_APP, "gvisor", "--once"), timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    info = queue.job(job)
    assert info.status == "done" and info.result["warmups"] == 1, info
    assert [r["key"] for r in cli.json("template", "list")["checkpoints"]] == [key]

    missing = cli.run("template", "rm", "no-such-key")
    assert missing.returncode == 1
    assert missing.stderr.strip() == ("error: no template or checkpoint 'no-such-key' "
                                      "(see tenantq template list)")
    assert cli.ok("template", "rm", key).strip() == "removed 1 template(s) and checkpoint(s)"
    assert cli.json("template", "list")["checkpoints"] == []
    assert not any((data_dir / "snapshots" / "gvisor" / "templates").glob("[!.]*"))


def test_rm_needs_keys_or_all(cli: Cli) -> None:
    res = cli.run("template", "rm")
    assert res.returncode == 1
    assert res.stderr.strip() == "error: name the templates or checkpoint keys to remove, or use --all"


@pytest.mark.parametrize(("flags", "message"), [
    (("--keep-warm", "5", "--hibernate-after", "10"),
     "error: --hibernate-after must be more than 0 and less than --keep-warm (10 vs 5)"),
    (("--max-batches-per-sandbox", "0"), "error: Invalid value for '--max-batches-per-sandbox'"),
])
def test_worker_refuses_bad_warm_flags(cli: Cli, flags: tuple[str, ...], message: str) -> None:
    res = cli.run(*worker_args(WARM_APP, "process", "--once", *flags))
    assert res.returncode in (1, 2)
    assert res.stderr.strip().splitlines()[-1].startswith(message), res.stderr
