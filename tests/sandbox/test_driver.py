"""The SandboxDriver contract, per driver: create from a spec, a work dir with
a quota, run with a timeout and a classified end, stdin, uid, limits, idempotent
destroy, a failing create that cleans up, and the TTL reaper."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

from tenantq.sandbox.cgroups import CgroupBox
from tenantq.sandbox.driver import GUEST_WORK_DIR, SandboxDriver
from tenantq.sandbox.drivers import gvisor, process
from tenantq.sandbox.layout import GUEST_UID, guest_python
from tenantq.sandbox.spec import TAIL_BYTES, Mount, ProcessResult, SandboxSpec
from tenantq.testing import wait_until
from tests.sandbox.conftest import SandboxFactory, cgroups_of, runsc_containers, sandbox_dirs

# expired_dirs() leaves a sandbox alone for this long past its deadline
REAP_GRACE_SECONDS = 5.0


def test_create_and_run_with_a_quota_work_dir(make_sandbox: SandboxFactory, python: str, data_dir: Path,
                                             driver_name: str) -> None:
    sandbox = make_sandbox(tenant="acme", labels={"batch": "42"})
    assert sandbox.work_dir.parent == data_dir / "sandboxes" / driver_name / sandbox.id
    # the work dir is a tmpfs of its own (rule H1: the host never reads what is in it)
    assert os.path.ismount(sandbox.work_dir)
    meta = json.loads((sandbox.work_dir.parent / "sandbox.json").read_text())
    assert meta["tenant"] == "acme" and meta["labels"] == {"batch": "42"} and meta["driver"] == driver_name

    blob = bytes(range(256)) * 64
    code = ("import hashlib, sys\n"
            "data = sys.stdin.buffer.read()\n"
            "open('in.bin', 'wb').write(data)\n"
            "print(hashlib.sha256(data).hexdigest(), file=sys.stderr)\n"
            "print('o' * 6000 + 'END-OUT')\n")
    result = sandbox.run([python, "-c", code], timeout=60, stdin=blob)
    assert result.end.kind == "ok", result
    assert result.exit_code == 0
    # tails: the end of the output, at most TAIL_BYTES of it
    assert result.stdout.endswith("END-OUT\n") and len(result.stdout) == TAIL_BYTES
    assert result.stderr == hashlib.sha256(blob).hexdigest() + "\n"
    # the work dir lives as long as the sandbox, across runs
    again = sandbox.run([python, "-c", "import hashlib; print(hashlib.sha256(open('in.bin', 'rb')"
                                       ".read()).hexdigest())"], timeout=60)
    assert again.stdout.strip() == hashlib.sha256(blob).hexdigest(), again


def test_the_work_dir_quota_gives_enospc_and_shows_in_statvfs(make_sandbox: SandboxFactory,
                                                              python: str) -> None:
    sandbox = make_sandbox(work_mb=8)
    code = ("import json, os\n"
            "st = os.statvfs('.')\n"
            "out = {'size': st.f_blocks * st.f_frsize}\n"
            "try:\n"
            "    with open('big', 'wb') as fh:\n"
            "        for _ in range(64):\n"
            "            fh.write(b'x' * (1 << 20)); fh.flush()\n"
            "    out['error'] = None\n"
            "except OSError as exc:\n"
            "    out['error'] = exc.errno\n"
            "print(json.dumps(out))\n")
    result = sandbox.run([python, "-c", code], timeout=60)
    seen = json.loads(result.stdout)
    assert seen["size"] == 8 << 20, seen
    assert seen["error"] == 28, seen  # ENOSPC


def test_stdin_reaches_the_command(make_sandbox: SandboxFactory, python: str) -> None:
    sandbox = make_sandbox()
    payload = b'{"SECRET": "s3cr3t"}\nsecond line\n'
    result = sandbox.run([python, "-c", "import sys; sys.stdout.write(sys.stdin.read()[::-1])"],
                         timeout=60, stdin=payload)
    assert result.end.ok, result
    assert result.stdout == payload.decode()[::-1]
    # stdin only: nothing of it on disk in the sandbox's dir
    for path in sandbox.work_dir.parent.glob("*"):
        if path.is_file():
            assert b"s3cr3t" not in path.read_bytes(), path


def test_guest_runs_as_nobody_in_a_minimal_root(make_sandbox: SandboxFactory, python: str) -> None:
    sandbox = make_sandbox()
    code = ("import os, json\n"
            "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'euid': os.geteuid(),\n"
            "  'cwd': os.getcwd(), 'etc': sorted(os.listdir('/etc')),\n"
            "  'shadow': os.path.exists('/etc/shadow'), 'home': os.path.exists('/home'),\n"
            "  'passwd': open('/etc/passwd').read()}))\n")
    result = sandbox.run([python, "-c", code], timeout=60)
    assert result.end.ok, result
    seen = json.loads(result.stdout)
    assert seen["uid"] == seen["euid"] == seen["gid"] == GUEST_UID
    assert seen["cwd"] == GUEST_WORK_DIR
    assert not seen["shadow"] and not seen["home"]
    assert "postgres" not in seen["passwd"], "the host's /etc is visible"


def test_timeout_ends_the_run_and_the_sandbox_stays_usable(make_sandbox: SandboxFactory, python: str) -> None:
    sandbox = make_sandbox()
    started = time.monotonic()
    result = sandbox.run([python, "-c", "import time; print('going', flush=True); time.sleep(60)"], timeout=1)
    elapsed = time.monotonic() - started
    assert result.end.kind == "timeout", result
    assert result.end.reason().startswith("timeout after"), result.end.reason()
    assert elapsed < 15, f"a 1 s timeout took {elapsed:.1f} s"
    again = sandbox.run([python, "-c", "print('still here')"], timeout=60)
    assert again.end.ok and again.stdout == "still here\n", again


def test_segfault_is_classified(make_sandbox: SandboxFactory, python: str) -> None:
    sandbox = make_sandbox()
    result = sandbox.run([python, "-c", "import os; os.kill(os.getpid(), 11)"], timeout=60)
    assert result.end.kind == "signal" and result.end.signal == 11, result
    assert result.end.reason() == "crashed: SIGSEGV"


@pytest.mark.parametrize("code", [3, 7, 42])
def test_exit_code_is_classified(make_sandbox: SandboxFactory, python: str, code: int) -> None:
    sandbox = make_sandbox()
    result = sandbox.run([python, "-c", f"import sys; print('bye'); sys.exit({code})"], timeout=60)
    assert result.exit_code == code, result
    assert result.end.kind == "exit" and result.end.exit_code == code
    assert result.end.reason() == f"crashed: exit code {code}"
    assert result.stdout == "bye\n"


def test_memory_limit_is_classified_as_oom(make_sandbox: SandboxFactory, python: str) -> None:
    sandbox = make_sandbox(memory_mb=128)
    # touch every page: a lazily mapped allocation would not count
    result = sandbox.run([python, "-c", "x = b'x' * (1024 << 20); print(len(x))"], timeout=60)
    assert result.end.kind == "oom", result
    assert result.end.reason() == "oom: exceeded 128 MiB"


def test_destroy_is_idempotent_and_removes_everything(make_sandbox: SandboxFactory, python: str,
                                                      data_dir: Path) -> None:
    sandbox = make_sandbox()
    assert sandbox.run([python, "-c", "open('f', 'w').write('x')"], timeout=60).end.ok
    path = sandbox.work_dir.parent
    box = CgroupBox(sandbox.id)
    assert path.is_dir()
    assert any(p.is_dir() for p in box.paths.values()), "the sandbox has no cgroup"
    sandbox.destroy()
    assert not path.exists()
    assert not any(p.exists() for p in box.paths.values())
    assert runsc_containers(data_dir) == []
    sandbox.destroy()  # again: no error, nothing changes
    assert not path.exists()
    with pytest.raises(RuntimeError, match="destroyed"):
        sandbox.run([python, "-c", "pass"], timeout=10)


def test_destroy_leaves_no_cgroup_in_any_hierarchy(make_sandbox: SandboxFactory, python: str) -> None:
    sandbox = make_sandbox()
    assert sandbox.run([python, "-c", "pass"], timeout=60).end.ok
    sandbox.destroy()
    left = cgroups_of(sandbox.id)
    assert left == [], f"destroy left cgroups behind: {[str(p) for p in left]}"


def test_destroy_right_after_a_run_removes_its_cgroups(make_sandbox: SandboxFactory, python: str) -> None:
    """The guest's last processes may still be exiting when run() returns:
    destroy must not leave their cgroups behind (repeated: it is a race)."""
    leaked: list[str] = []
    for _ in range(8):
        sandbox = make_sandbox()
        assert sandbox.run([python, "-c", "open('f', 'w').write('x')"], timeout=60).end.ok
        sandbox.destroy()
        leaked += [str(p) for p in CgroupBox(sandbox.id).paths.values() if p.exists()]
    assert leaked == [], f"destroy left cgroups behind: {leaked}"


def test_destroy_while_running_kills_the_command(make_sandbox: SandboxFactory, python: str,
                                                 data_dir: Path) -> None:
    sandbox = make_sandbox()
    results: list[ProcessResult] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(sandbox.run(
                [python, "-c", "import time; open('up', 'w').write('1'); time.sleep(60)"], timeout=60))
        except BaseException as exc:
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    wait_until(lambda: (sandbox.work_dir / "up").exists(), timeout=30, message="the command to start")
    sandbox.destroy()
    runner.join(timeout=30)
    assert not runner.is_alive(), "run() did not return after destroy()"
    assert not sandbox.work_dir.parent.exists()
    assert runsc_containers(data_dir) == []
    assert errors == [], f"run() raised instead of returning a killed result: {errors!r}"
    assert results and not results[0].end.ok, results


def _fail_after(original: object) -> object:
    def create(self: CgroupBox, **kwargs: object) -> None:
        original(self, **kwargs)  # type: ignore[operator]
        raise OSError("injected: cgroup setup failed")

    return create


def test_failing_create_cleans_up(driver: SandboxDriver, driver_name: str, data_dir: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SandboxSpec(tenant="acme", memory_mb=128, mounts=guest_python().mounts)
    module = gvisor if driver_name == "gvisor" else process

    def broken_skeleton(*args: object, **kwargs: object) -> Path:
        raise OSError("injected: no skeleton")

    with monkeypatch.context() as patch:
        patch.setattr(module, "build_skeleton", broken_skeleton)
        with pytest.raises(OSError, match="no skeleton"):
            driver.create(spec)
    assert sandbox_dirs(data_dir) == []

    # fails after its cgroups exist: they go too
    with monkeypatch.context() as patch:
        patch.setattr(CgroupBox, "create", _fail_after(CgroupBox.create))
        with pytest.raises(OSError, match="cgroup setup failed"):
            driver.create(spec)
    assert sandbox_dirs(data_dir) == []


def test_create_rejects_a_mount_whose_source_does_not_exist(driver: SandboxDriver, data_dir: Path,
                                                            tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    spec = SandboxSpec(tenant="acme", memory_mb=128,
                       mounts=(*guest_python().mounts, Mount(str(missing), "/opt/app")))
    error: Exception | None = None
    try:
        sandbox = driver.create(spec)
    except Exception as exc:  # any clear error that names the path
        error = exc
    else:
        sandbox.destroy()
    assert sandbox_dirs(data_dir) == []
    assert error is not None, (f"create accepted a mount whose source {missing} does not exist; "
                               "the first run then fails with a confusing error instead")
    assert "no-such-dir" in str(error), error


def test_reaper_removes_a_sandbox_past_its_deadline(driver: SandboxDriver, make_sandbox: SandboxFactory,
                                                    python: str, data_dir: Path) -> None:
    # a dispatcher that crashed after create: nobody will call destroy(). The
    # TTL leaves room for one Python start under gVisor on a loaded machine
    # (1 s was not always enough: the run itself timed out in CI)
    orphan = make_sandbox(ttl_seconds=3)
    assert orphan.run([python, "-c", "open('result', 'w').write('x')"], timeout=30).end.ok
    keeper = make_sandbox(ttl_seconds=300)
    assert orphan.id not in driver.reap(), "reaped before its deadline (plus grace) passed"
    orphan_dir, orphan_box = orphan.work_dir.parent, CgroupBox(orphan.id)

    removed: set[str] = set()

    def reaped() -> bool:
        removed.update(driver.reap())
        return orphan.id in removed

    deadline = json.loads((orphan_dir / "sandbox.json").read_text())["deadline"]
    wait_until(reaped, timeout=REAP_GRACE_SECONDS + 20, interval=0.5, message="the reaper to remove it")
    assert time.time() > deadline, "reaped before its deadline"
    assert not orphan_dir.exists()
    assert not any(p.exists() for p in orphan_box.paths.values())
    assert runsc_containers(data_dir) == []
    # the live sandbox is untouched and still works
    assert keeper.id not in removed
    assert keeper.work_dir.is_dir()
    assert keeper.run([python, "-c", "print(1)"], timeout=60).end.ok
    assert os.path.isdir(keeper.work_dir)
