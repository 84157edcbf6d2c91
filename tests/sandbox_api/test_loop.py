"""The loop hosted-sandbox users write (create from a template, write the
input and the code, exec with a timeout, read the result file, delete),
for an ok job, a failing one, a timing-out one and an OOM one, many times
over, leaving nothing behind (the data_dir fixture checks: no container,
dir, cgroup, mount or process); and the same loop with a warmed parent
forked per job."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tenantq import Sandbox

ITERATIONS = int(os.environ.get("TENANTQ_SDK_LOOP_ITERATIONS", "100"))
CODE = """
import json, sys, time
job = json.load(open("/work/input.json"))
if job["kind"] == "fail":
    print("bad input: " + job["kind"], file=sys.stderr)
    sys.exit(2)
if job["kind"] == "slow":
    time.sleep(60)
if job["kind"] == "hog":
    hog = bytearray(1 << 30)
json.dump({"n": job["n"], "square": job["n"] ** 2}, open("/work/output.json", "w"))
"""
KINDS = ("ok", "fail", "slow", "hog")


def _one(sbx: Sandbox, n: int, kind: str) -> None:
    sbx.filesystem.write("/work/input.json", json.dumps({"n": n, "kind": kind}))
    sbx.filesystem.write("/work/job.py", CODE)
    # the timing-out job gets a short timeout (it only waits); the others a long one
    result = sbx.run("cd /work && python3 job.py", timeout_seconds=0.5 if kind == "slow" else 30)
    if kind == "ok":
        assert result.ok, result
        assert json.loads(sbx.filesystem.read_text("/work/output.json")) == {"n": n, "square": n * n}
    elif kind == "fail":
        assert result.exit_code == 2 and result.stderr == "bad input: fail\n", result
        assert not sbx.filesystem.exists("/work/output.json")
    elif kind == "slow":
        assert result.reason == "timeout after 0.5 s", result
    else:
        assert result.reason.startswith("oom"), result


def test_the_create_write_exec_read_delete_loop(driver_name: str, data_dir: Path) -> None:
    # the four kinds' loops side by side (a timing-out job only waits), each
    # ITERATIONS / 4 times in a row: ITERATIONS sandboxes in all
    def loop(kind: str) -> int:
        for n in range(ITERATIONS // len(KINDS)):
            with Sandbox.create(driver=driver_name, ttl_seconds=60, memory_mb=192,
                                metadata={"loop": kind}) as sbx:
                _one(sbx, n, kind)
        return ITERATIONS // len(KINDS)

    with ThreadPoolExecutor(max_workers=len(KINDS)) as pool:
        done = list(pool.map(loop, KINDS))  # re-raises the first failure
    assert sum(done) == ITERATIONS // len(KINDS) * len(KINDS)
    assert Sandbox.list() == []


def test_the_loop_with_a_warmed_parent_forked_per_job(driver_name: str, data_dir: Path) -> None:
    if driver_name != "gvisor":
        pytest.skip("process: bubblewrap cannot fork (NotSupported, tested in test_api.py)")
    with Sandbox.create(driver=driver_name, ttl_seconds=300, memory_mb=192) as parent:
        # the warm state every child inherits: a file and an imported module tree
        parent.filesystem.write("/work/warm.txt", "warmed")
        assert parent.run("python3 -c 'import json, decimal, email.parser'").ok
        for n in range(ITERATIONS // 8):  # 3 of each kind: the fork is what differs
            kind = KINDS[n % len(KINDS)]
            with parent.fork(ttl_seconds=60) as child:
                assert child.filesystem.read_text("/work/warm.txt") == "warmed"
                _one(child, n, kind)
        assert not parent.filesystem.exists("/work/input.json")  # no child wrote into the parent
    assert Sandbox.list() == []
