"""A sandbox outlives the process that made it, to its TTL and no longer;
other processes find it (`Sandbox.list`), drive it (`Sandbox.connect`, the
CLI) and end it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tenantq import InvalidInput, Sandbox
from tenantq.sandbox.api import SandboxNotFound, remove_sandbox
from tenantq.sandbox.drivers import get_driver
from tenantq.testing import wait_until
from tests.sandbox.conftest import processes_mentioning

ROOT = Path(__file__).resolve().parents[2]
CREATOR = """
import sys, time
from tenantq import Sandbox
sbx = Sandbox.create(driver=sys.argv[1], ttl_seconds=float(sys.argv[2]), metadata={"owner": "creator"})
sbx.exec("sleep 600", background=True)
print(sbx.id, flush=True)
time.sleep(600)
"""


def _env(data_dir: Path) -> dict[str, str]:
    return {**os.environ, "TENANTQ_DATA_DIR": str(data_dir),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_the_ttl_ends_a_sandbox_whose_creator_was_killed(driver_name: str, data_dir: Path) -> None:
    creator = subprocess.Popen([sys.executable, "-c", CREATOR, driver_name, "6"], env=_env(data_dir),
                               stdout=subprocess.PIPE, text=True)
    try:
        assert creator.stdout is not None
        sandbox_id = creator.stdout.readline().strip()
        assert sandbox_id.startswith("tq-"), sandbox_id
        os.kill(creator.pid, signal.SIGKILL)
        creator.wait(10)
        # it outlives its creator: another process finds it and drives it
        assert [i.id for i in Sandbox.list(metadata={"owner": "creator"})] == [sandbox_id]
        other = Sandbox.connect(sandbox_id)
        assert other.run("echo still here").stdout == "still here\n"
        other.close()
        # ... until its TTL: then nothing of it runs any more (no host process names its dir)
        marker = str(data_dir / "sandboxes")
        wait_until(lambda: not [p for p in processes_mentioning(marker) if sandbox_id in p[1]
                                or "runsc" in p[1] or "bwrap" in p[1]],
                   timeout=30, interval=0.2, message="the sandbox to end at its TTL")
        assert Sandbox.list(metadata={"owner": "creator"}) == []
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(sandbox_id)
        # and the reaper removes what it left on the host (its dir, cgroups, runsc state)
        driver, _ = get_driver(driver_name, data_dir)
        wait_until(lambda: sandbox_id in driver.reap() or not (data_dir / "sandboxes" / driver_name /
                                                                 sandbox_id).exists(),
                   timeout=20, interval=0.5, message="the reaper to remove the sandbox")
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.wait(10)
        if creator.stdout is not None:
            creator.stdout.close()


def test_connect_drives_a_sandbox_from_another_process_and_delete_ends_it(driver_name: str,
                                                                          data_dir: Path) -> None:
    sbx = Sandbox.create(driver=driver_name, ttl_seconds=60, metadata={"job": "connect"})
    try:
        sbx.filesystem.write("/shared/note", "from the creator")
        code = ("import sys; from tenantq import Sandbox; s = Sandbox.connect(sys.argv[1]); "
                "print(s.filesystem.read_text('/shared/note')); s.filesystem.write('/shared/reply', 'ok'); "
                "print(s.run('echo $((6 * 7))').stdout.strip()); s.close()")
        done = subprocess.run([sys.executable, "-c", code, sbx.id], env=_env(data_dir), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split("\n")[:2] == ["from the creator", "42"]
        assert sbx.filesystem.read_text("/shared/reply") == "ok"
        assert sbx.run("true").ok  # the creator's own channel still works
        second = Sandbox.connect(sbx.id)
        assert second.delete() is True
        wait_until(lambda: not sbx.is_running() or not sbx.run("true").ok, timeout=10,
                   message="the creator to see the sandbox gone")
    finally:
        sbx.delete()


def test_connect_and_remove_refuse_bad_ids(data_dir: Path) -> None:
    for bad in ("", "tq-xyz", "../../etc", "tq-0123456789ab/../x"):
        with pytest.raises(InvalidInput, match="not a sandbox id"):
            Sandbox.connect(bad)
    with pytest.raises(SandboxNotFound, match="no running sandbox tq-0123456789ab"):
        Sandbox.connect("tq-0123456789ab")
    assert remove_sandbox("tq-0123456789ab") is False


def test_the_cli_mirrors_the_api(driver_name: str, data_dir: Path, tmp_path: Path) -> None:
    env = _env(data_dir)
    cmd = [sys.executable, "-m", "tenantq.cli", "sandbox"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=90)

    made = run("create", "--driver", driver_name, "--ttl", "60", "--meta", "job=cli", "--env", "WHO=cli")
    assert made.returncode == 0, made.stderr
    sandbox_id = made.stdout.strip()
    try:
        listed = run("ls", "--meta", "job=cli")
        assert sandbox_id in listed.stdout and "job=cli" in listed.stdout
        local = tmp_path / "in.txt"
        local.write_text("payload\n")
        assert run("cp", str(local), f"{sandbox_id}:/work/in.txt").returncode == 0
        shown = run("exec", sandbox_id, "cat /work/in.txt; echo $WHO")
        assert (shown.returncode, shown.stdout) == (0, "payload\ncli\n"), shown.stderr
        assert run("exec", sandbox_id, "exit 3").returncode == 3
        timed = run("exec", "--timeout", "1", sandbox_id, "sleep 30")
        assert timed.returncode == 124 and "timeout after 1 s" in timed.stderr
        assert run("exec", sandbox_id, "python3", "-c", "print('argv')").stdout == "argv\n"
        files = run("ls", f"{sandbox_id}:/work")
        assert "file\t8\tin.txt" in files.stdout, files.stdout
        back = tmp_path / "back.txt"
        assert run("cp", f"{sandbox_id}:/work/in.txt", str(back)).returncode == 0
        assert back.read_text() == "payload\n"
        bad = run("exec", "nope", "true")
        assert bad.returncode != 0 and "not a sandbox id" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    finally:
        removed = run("rm", sandbox_id)
    assert f"{sandbox_id}: removed" in removed.stdout
    assert f"{sandbox_id}: already gone" in run("rm", sandbox_id).stdout
    assert not (data_dir / "sandboxes" / driver_name / sandbox_id).exists()
