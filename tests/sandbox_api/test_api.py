"""The Sandbox API's contract (docs/sandbox-api.md), on both drivers."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from tenantq import InvalidInput, Sandbox
from tenantq.sandbox import Client
from tenantq.sandbox.api import NotSupported

MIB = 1 << 20


@pytest.fixture
def sbx(driver_name: str, data_dir: Path) -> Sandbox:
    sandbox = Sandbox.create(driver=driver_name, ttl_seconds=120, metadata={"purpose": "test"},
                             envs={"GREETING": "hello"}, secrets={"API_TOKEN": "tok-123"}, memory_mb=256)
    yield sandbox  # type: ignore[misc]
    sandbox.delete()


def test_exec_shell_strings_argv_cwd_env_stdin_and_secrets(sbx: Sandbox) -> None:
    result = sbx.run("echo $GREETING $API_TOKEN; echo to-stderr >&2")
    assert result.ok and result.exit_code == 0 and result.reason == "ok", result
    assert result.stdout == "hello tok-123\n" and result.stderr == "to-stderr\n"
    argv = sbx.run(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "c"])
    assert argv.stdout == "['a b', 'c']\n"
    sbx.filesystem.make_dir("/work")
    assert sbx.run("pwd", cwd="/work").stdout == "/work\n"
    assert sbx.run("echo $X", envs={"X": "per-exec"}).stdout == "per-exec\n"
    assert sbx.run("cat", stdin="from stdin").stdout == "from stdin"
    # the secrets went over the agent's channel: not in the host's sandbox files
    host_files = [p for p in sbx.host.path.rglob("*")
                  if p.is_file() and not p.is_relative_to(sbx.host.work_dir)]
    assert all(b"tok-123" not in p.read_bytes() for p in host_files)


def test_a_shell_and_python3_state_persists_between_execs(sbx: Sandbox) -> None:
    assert sbx.run("cd /work 2>/dev/null || mkdir /work; cd /work && echo 41 > n").ok
    assert sbx.run("cd /work && python3 -c 'print(int(open(\"n\").read()) + 1)'").stdout == "42\n"


def test_files_at_any_absolute_path(sbx: Sandbox) -> None:
    fs = sbx.filesystem
    for path in ("/work/input.json", "/workspace/payload.json", "/run/jobs/batch.json", "/tmp/x.json"):
        assert fs.write(path, json.dumps({"path": path})) > 0
        assert json.loads(fs.read_text(path)) == {"path": path}
        assert sbx.run(f"cat {path}").stdout == json.dumps({"path": path})
    blob = bytes(range(256)) * (3 * MIB // 256 + 7)  # several chunks, not a multiple of one
    fs.write("/data/blob.bin", blob)
    assert fs.read("/data/blob.bin") == blob
    with pytest.raises(ValueError, match="max_bytes"):
        fs.read("/data/blob.bin", max_bytes=MIB)
    assert fs.exists("/data/blob.bin") and not fs.exists("/data/missing")
    assert fs.make_dir("/data/sub/deeper") is True and fs.make_dir("/data/sub/deeper") is False
    entries = {e.name: e for e in fs.list("/data")}
    assert entries["blob.bin"].type == "file" and entries["blob.bin"].size == len(blob)
    assert entries["sub"].type == "dir" and entries["blob.bin"].path == "/data/blob.bin"
    fs.remove("/data")
    assert not fs.exists("/data/blob.bin")
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        fs.read("/nowhere")
    with pytest.raises(IsADirectoryError):
        fs.read("/run")
    with pytest.raises(OSError, match="/usr/bin/evil"):
        fs.write("/usr/bin/evil", "read-only system mount")
    with pytest.raises(InvalidInput, match="absolute"):
        fs.write("relative/path", "x")


def test_a_guest_symlink_is_the_guest_s_own_business(sbx: Sandbox, data_dir: Path) -> None:
    # the host never follows a path: a link to a host path resolves inside the sandbox
    secret = data_dir / "host-secret.txt"
    secret.write_text("host only")
    assert sbx.run(f"ln -s {secret} /link && mkdir -p /d && ln -s / /d/root").ok
    with pytest.raises(FileNotFoundError):
        sbx.filesystem.read("/link")
    with contextlib.suppress(OSError):  # inside, it lands in the sandbox's own root (or fails there)
        sbx.filesystem.write("/d/root/written-through-link", "x")
    assert not Path("/written-through-link").exists()


def test_exit_codes_signals_timeouts_and_oom_are_classified(sbx: Sandbox) -> None:
    failed = sbx.run("echo oops >&2; exit 3")
    assert (failed.exit_code, failed.reason, failed.stderr) == (3, "exit code 3", "oops\n")
    killed = sbx.run("kill -TERM $$")
    assert killed.reason == "killed by signal 15 (SIGTERM)", killed
    timed_out = sbx.run("echo started; sleep 30", timeout_seconds=1)
    assert timed_out.reason == "timeout after 1 s" and timed_out.stdout == "started\n", timed_out
    assert timed_out.seconds < 10
    missing = sbx.run(["no-such-binary"])
    assert missing.exit_code == 127 and "no-such-binary" in missing.stderr
    oom = sbx.run("python3 -c 'b = bytearray(1 << 30)'", timeout_seconds=60)
    assert oom.reason.startswith("oom"), oom


def test_output_is_whole_up_to_its_cap_and_truncation_is_marked(sbx: Sandbox) -> None:
    whole = sbx.run("head -c 1000000 /dev/zero | tr '\\0' a")
    assert len(whole.stdout) == 1_000_000 and not whole.stdout_truncated
    flood = sbx.run("head -c 5000000 /dev/zero | tr '\\0' b; echo done >&2")
    assert len(flood.stdout) == MIB and flood.stdout_truncated and not flood.stderr_truncated
    assert flood.stderr == "done\n" and flood.ok
    small = sbx.run("seq 1 1000", output_cap=100)
    assert len(small.stdout) == 100 and small.stdout_truncated
    seen: list[str] = []
    streamed = sbx.run("for i in 1 2 3; do echo line$i; done", on_stdout=seen.append)
    assert "".join(seen) == streamed.stdout == "line1\nline2\nline3\n"


def within(condition: str, seconds: float = 10.0) -> str:
    """A command that polls `condition` in the guest every 50 ms until it
    holds (exit 0) or `seconds` pass (exit 1): a deadline, not a fixed sleep
    (a python3 start under gVisor on a loaded host can take over 0.2 s)."""
    return f"for i in $(seq {int(seconds / 0.05)}); do {condition} && exit 0; sleep 0.05; done; exit 1"


def test_background_processes_live_on_and_can_be_killed(sbx: Sandbox) -> None:
    server = sbx.exec("python3 -c 'import time\nwhile True:\n open(\"/tmp/beat\",\"a\").write(\"x\")\n "
                      "time.sleep(0.05)'", background=True)
    assert isinstance(server.pid, int) and server.pid > 1
    assert sbx.run(within("test -s /tmp/beat")).ok  # it runs between execs
    assert sbx.run(f"kill -0 {server.pid}").ok
    assert server.kill() is True
    ended = server.wait(timeout=10)
    assert ended.reason == "killed by signal 9 (SIGKILL)"
    assert server.kill() is False
    talker = sbx.exec("cat", background=True)
    talker.send_stdin("ping\n")
    talker.close_stdin()
    assert talker.wait(timeout=10).stdout == "ping\n"
    with pytest.raises(TimeoutError):
        sbx.exec("sleep 30", background=True).wait(timeout=0.2)


def test_delete_is_idempotent_and_with_deletes(driver_name: str, data_dir: Path) -> None:
    with Client().sandboxes.create(driver=driver_name, ttl_seconds=60) as sbx:
        assert sbx.is_running()
        host_dir = sbx.host.path
        assert host_dir.is_dir()
    assert not host_dir.exists() and not sbx.is_running()
    assert sbx.delete() is False


def test_set_ttl_ends_the_sandbox_on_time(driver_name: str, data_dir: Path) -> None:
    sbx = Sandbox.create(driver=driver_name, ttl_seconds=120)
    try:
        handle = sbx.exec("sleep 300", background=True)
        sbx.set_ttl(2)
        ended = handle.wait(timeout=20)  # the agent ends the sandbox at the new deadline
        assert ended.exit_code is None and "TTL" in ended.reason, ended
        assert not sbx.is_running()
    finally:
        sbx.delete()


def test_fork_children_start_from_the_parent_and_never_touch_it(driver_name: str, data_dir: Path) -> None:
    parent = Sandbox.create(driver=driver_name, ttl_seconds=120)
    try:
        if driver_name != "gvisor":
            with pytest.raises(NotSupported, match="cannot fork"):
                parent.fork()
            return
        parent.filesystem.write("/state/who", "parent")
        # written whole by a rename: a fork (or a read) between a truncate and
        # its write would otherwise see an empty file (seen once on CI)
        counter = parent.exec("python3 -c 'import os, time\nn = 0\nwhile True:\n n += 1\n "
                              "open(\"/state/n.tmp\", \"w\").write(str(n))\n "
                              "os.replace(\"/state/n.tmp\", \"/state/n\")\n time.sleep(0.02)'",
                              background=True)
        assert parent.run(within("test -s /state/n")).ok
        children = parent.fork_many(2, ttl_seconds=60)
        try:
            assert parent.last_fork is not None and parent.last_fork.parent_paused_seconds > 0
            ids = {parent.id, *(c.id for c in children)}
            assert len(ids) == 3
            for child in children:
                assert child.filesystem.read_text("/state/who") == "parent"
                child.filesystem.write("/state/who", f"child {child.id}")
                # the parent's counter process came along, and keeps counting in the child
                before = int(child.filesystem.read_text("/state/n"))
                assert child.run(within(f"test $(cat /state/n) -gt {before}")).ok
            assert parent.filesystem.read_text("/state/who") == "parent"
            assert [c.filesystem.read_text("/state/who") for c in children] == \
                [f"child {c.id}" for c in children]
            randoms = {c.run("python3 -c 'import os; print(os.urandom(8).hex())'").stdout for c in children}
            assert len(randoms) == 2
            assert parent.run("true").ok and counter.kill() is True  # the parent's handle still works
            solo = children[0].fork(ttl_seconds=30)
            assert solo.filesystem.read_text("/state/who") == f"child {children[0].id}"
            solo.delete()
        finally:
            for child in children:
                child.delete()
    finally:
        parent.delete()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"template": "nope"}, "unknown template 'nope'"),
    ({"ttl_seconds": 0}, "ttl_seconds must be a positive finite number"),
    ({"ttl_seconds": float("nan")}, "ttl_seconds must be a positive finite number"),
    ({"ttl_seconds": 10**9}, "ttl_seconds must be at most"),
    ({"timeout_seconds": -1}, "timeout_seconds must be a positive finite number"),
    ({"metadata": {"bad key!": "x"}}, "metadata: bad name"),
    ({"metadata": {"k": 3}}, "metadata['k'] must be a string"),
    ({"envs": {"1X": "y"}}, "envs: bad name"),
    ({"secrets": {"S": "a\0b"}}, "secrets['S'] must be a string without NUL"),
    ({"tenant": "no spaces"}, "tenant must be"),
    ({"memory_mb": 1}, "memory_mb must be an integer from 64"),
    ({"cpus": float("inf")}, "cpus must be a positive finite number"),
    ({"driver": "teleport"}, "unknown sandbox driver 'teleport'"),
    ({"egress": ["http://api.example.com/path"]}, "egress rule"),
])
def test_bad_create_arguments_get_one_line_errors(kwargs: dict[str, object], message: str,
                                                  data_dir: Path) -> None:
    with pytest.raises((InvalidInput, NotSupported)) as caught:
        Sandbox.create(**kwargs)  # type: ignore[arg-type]
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert not (data_dir / "sandboxes").exists() or not any((data_dir / "sandboxes").rglob("tq-*"))


def test_bad_exec_arguments_get_one_line_errors(sbx: Sandbox) -> None:
    for kwargs, message in [({"cmd": ""}, "cmd is empty"), ({"cmd": []}, "cmd must be"),
                            ({"cmd": ["a", 1]}, "cmd must be"), ({"cmd": "x", "cwd": "rel"}, "cwd must be"),
                            ({"cmd": "x", "timeout_seconds": 0}, "timeout_seconds must be"),
                            ({"cmd": "x", "output_cap": -1}, "output_cap must be")]:
        with pytest.raises(InvalidInput, match=message):
            sbx.exec(**kwargs)  # type: ignore[arg-type]
    assert sbx.run("true").ok
