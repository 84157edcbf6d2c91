"""The writable layer's quota (docs/sandbox-api.md, "Files" and "Known
limits"): what `statvfs` shows, what a command that fills it gets, and that
the sandbox goes on, on each driver as documented.

Under bubblewrap the layer is one tmpfs of its own (`/`, `/tmp`,
`/dev/shm`, `/work`, ...) of half of `memory_mb` and one inode per 4 KiB:
filling it gets ENOSPC, and the sandbox, its agent and its files survive,
even when a command then runs out of memory. Under gVisor the root's layer
(`--overlay2=root:memory`) has no size of its own: filling it reaches the
memory limit, which ends the whole sandbox; `/tmp` is a 64 MiB tmpfs there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tenantq import Sandbox
from tenantq.sandbox.agent_link import SandboxGone
from tenantq.sandbox.drivers.process import LAYER_DIR, ProcessDriver, writable_layer
from tenantq.testing import wait_until

MIB = 1 << 20
MEMORY_MB = 256
# writable_layer(256): half of memory_mb, one inode per 4 KiB of it
LAYER_MB, LAYER_INODES = 128, 32768
GVISOR_TMP_MB = 64
# more than any file this suite writes could fill
FILL = "head -c 4096M /dev/zero"
LAYER_PATHS = ("/", "/work", "/workspace", "/run", "/tmp", "/dev/shm", "/tenantq/work", "/data/deeper")
# empty files in a new directory until the layer says no: how many, and errno
MANY_FILES = """
import os, sys
os.makedirs(sys.argv[1])
n = 0
try:
    while True:
        open(os.path.join(sys.argv[1], str(n)), "w").close()
        n += 1
except OSError as e:
    print(n, e.errno)
"""
STATVFS = """
import json, os, sys
out = {}
for p in sys.argv[1:]:
    s = os.statvfs(p)
    out[p] = {"bytes": s.f_blocks * s.f_frsize, "free": s.f_bavail * s.f_frsize, "files": s.f_files,
              "dev": os.stat(p).st_dev}
print(json.dumps(out))
"""


def only(driver_name: str, wanted: str, why: str) -> None:
    if driver_name != wanted:
        pytest.skip(f"{driver_name}: {why}")


def statvfs(sbx: Sandbox, *paths: str) -> dict[str, dict[str, int]]:
    result = sbx.run(["python3", "-c", STATVFS, *paths])
    assert result.ok, result
    return dict(json.loads(result.stdout))


def layer_name(sbx: Sandbox) -> str:
    return f"tenantq-{sbx.id}-layer"


def host_mounts() -> set[str]:
    """The sources of the host's mounts (this process's mount namespace)."""
    return {line.split()[0] for line in Path("/proc/self/mounts").read_text().splitlines()}


@pytest.fixture
def sbx(driver_name: str, data_dir: Path):  # type: ignore[no-untyped-def]
    with Sandbox.create(driver=driver_name, ttl_seconds=180, memory_mb=MEMORY_MB) as sandbox:
        yield sandbox


def test_the_layer_size_is_half_of_memory_mb_and_one_inode_per_4_kib() -> None:
    assert writable_layer(MEMORY_MB) == (LAYER_MB, LAYER_INODES)
    assert writable_layer(64) == (32, 8192)
    assert writable_layer(513) == (256, 65536)


def test_statvfs_of_every_writable_path_shows_the_layer_quota(sbx: Sandbox, driver_name: str) -> None:
    only(driver_name, "process", "gVisor's root layer has no size (see the gvisor test below)")
    sbx.filesystem.make_dir("/data/deeper")
    seen = statvfs(sbx, *LAYER_PATHS)
    for path in LAYER_PATHS:
        assert seen[path]["bytes"] == LAYER_MB * MIB, (path, seen[path])
        assert seen[path]["files"] == LAYER_INODES, (path, seen[path])
        # one filesystem: a byte written anywhere counts against the same quota
        assert seen[path]["dev"] == seen["/"]["dev"], (path, seen)
    # the read-only system mounts are not the layer
    assert statvfs(sbx, "/usr")["/usr"]["dev"] != seen["/"]["dev"]


def test_under_gvisor_statvfs_shows_tmp_s_quota_not_the_root_s(sbx: Sandbox, driver_name: str) -> None:
    only(driver_name, "gvisor", "the process driver's layer has a quota (the test above)")
    seen = statvfs(sbx, "/", "/work", "/tmp")
    assert seen["/tmp"]["bytes"] == GVISOR_TMP_MB * MIB, seen
    for path in ("/", "/work"):  # the memory overlay reports no real size
        assert seen[path]["bytes"] > (1 << 40), seen


def test_filling_the_layer_gets_enospc_and_the_sandbox_goes_on(sbx: Sandbox, driver_name: str) -> None:
    only(driver_name, "process", "under gVisor filling the root ends the sandbox (tested below)")
    sbx.filesystem.write("/work/before.txt", "written before")
    ooms = sbx.oom_count()
    filled = sbx.run(f"{FILL} > /workspace/fill")
    assert filled.exit_code == 1 and "No space left on device" in filled.stderr, filled
    after = statvfs(sbx, "/", "/tmp")
    assert after["/"]["free"] == 0 and after["/tmp"]["free"] == 0, after
    # every writable path is full, the API's writes too
    for path in ("/tmp/more", "/dev/shm/more", "/work/more"):
        more = sbx.run(f"head -c 4096 /dev/zero > {path}")
        assert more.exit_code != 0 and "No space left on device" in more.stderr, (path, more)
    with pytest.raises(OSError, match="No space left on device"):
        sbx.filesystem.write("/run/api.bin", b"x" * MIB)
    # nobody was killed for memory: the full layer is far below the limit
    assert sbx.oom_count() == ooms
    assert sbx.is_running()
    assert sbx.run("echo alive").stdout == "alive\n"
    assert sbx.filesystem.read_text("/work/before.txt") == "written before"
    assert sbx.run("cat /work/before.txt").stdout == "written before"
    # removing the file gives the space back
    assert sbx.run("rm /workspace/fill").ok
    assert sbx.run(f"head -c {8 * MIB} /dev/zero > /tmp/after && echo ok").stdout == "ok\n"


def test_too_many_files_get_enospc_too(sbx: Sandbox, driver_name: str) -> None:
    """Empty files take no pages but ~1 KiB of kernel memory each, charged to
    the sandbox: the inode count bounds them as the size bounds bytes."""
    only(driver_name, "process", "under gVisor the memory limit is the only bound (it ends the sandbox)")
    sbx.filesystem.write("/work/before.txt", "written before")
    ooms = sbx.oom_count()
    made = sbx.run(["python3", "-c", MANY_FILES, "/work/many"], timeout_seconds=120)
    assert made.ok, made
    count, errno = (int(x) for x in made.stdout.split())
    assert errno == 28 and LAYER_INODES - 200 < count < LAYER_INODES, made.stdout
    assert statvfs(sbx, "/")["/"]["free"] > 100 * MIB  # the bytes were not the limit
    assert sbx.oom_count() == ooms
    assert sbx.run("echo alive").stdout == "alive\n"
    assert sbx.filesystem.read_text("/work/before.txt") == "written before"
    assert sbx.run("rm -r /work/many").ok
    assert sbx.run("touch /work/new && echo ok").stdout == "ok\n"


def test_a_full_layer_and_a_memory_hog_cost_the_hog_not_the_sandbox(sbx: Sandbox, driver_name: str) -> None:
    """The case that used to end the sandbox: tmpfs pages outlive their
    writer, so a layer that could hold the whole limit left the memory
    cgroup nothing to kill but the agent."""
    only(driver_name, "process", "under gVisor the memory limit ends the whole sandbox (documented)")
    sbx.filesystem.write("/work/before.txt", "written before")
    assert sbx.run(f"{FILL} > /workspace/fill").exit_code == 1
    many = sbx.run(["python3", "-c", MANY_FILES, "/run/many"], timeout_seconds=120)
    assert many.ok and many.stdout.endswith(" 28\n"), many
    hog = sbx.run("python3 -c 'b = bytearray(1 << 30)'", timeout_seconds=60)
    assert hog.reason == f"oom: exceeded {MEMORY_MB} MiB", hog
    assert sbx.is_running()
    assert sbx.run("echo alive").stdout == "alive\n"
    assert sbx.filesystem.read_text("/work/before.txt") == "written before"
    # and again, with a background command holding memory when the hog starts
    holder = sbx.exec("python3 -c 'import sys; b = bytearray(40 << 20); sys.stdin.read()'", background=True)
    assert sbx.run("python3 -c 'b = bytearray(1 << 30)'", timeout_seconds=60).reason.startswith("oom")
    holder.kill()
    holder.wait(timeout=30)
    assert sbx.run("cat /work/before.txt").stdout == "written before"


def test_under_gvisor_tmp_fills_with_enospc_and_the_sandbox_goes_on(sbx: Sandbox, driver_name: str) -> None:
    only(driver_name, "gvisor", "the process driver's /tmp is on the layer (tested above)")
    sbx.filesystem.write("/work/before.txt", "written before")
    filled = sbx.run(f"{FILL} > /tmp/fill")
    assert filled.exit_code == 1 and "No space left on device" in filled.stderr, filled
    assert sbx.run("echo alive").stdout == "alive\n"
    assert sbx.filesystem.read_text("/work/before.txt") == "written before"


def test_under_gvisor_filling_the_root_ends_the_whole_sandbox(sbx: Sandbox, driver_name: str) -> None:
    only(driver_name, "gvisor", "under bubblewrap the layer has a quota and the sandbox goes on (above)")
    filled = sbx.run(f"{FILL} > /work/fill", timeout_seconds=120)
    assert filled.reason.startswith(f"oom: exceeded {MEMORY_MB} MiB"), filled
    assert not sbx.is_running()
    with pytest.raises(SandboxGone):
        sbx.run("echo alive")


def test_the_layer_is_the_sandbox_s_own_mount_and_goes_with_it(driver_name: str, data_dir: Path) -> None:
    """The layer is mounted in a mount namespace of the sandbox's own: no
    host path shows the guest's files, and nothing needs unmounting."""
    only(driver_name, "process", "gVisor's layer is the sentry's memory: no mount at all")
    marker = "tq-layer-marker-0f4d"
    with Sandbox.create(driver=driver_name, ttl_seconds=180, memory_mb=MEMORY_MB) as sbx:
        sbx.filesystem.write("/work/marker.txt", marker)
        inside = sbx.run("cat /proc/self/mountinfo").stdout
        # mountinfo: ID PARENT DEV ROOT MOUNTPOINT OPTIONS ... - FSTYPE SOURCE SUPER_OPTIONS
        layer = {line.split()[4]: line.split(" - ")[1].split()[:2] for line in inside.splitlines()}
        assert layer["/"] == layer["/dev/shm"] == ["tmpfs", layer_name(sbx)], inside
        assert layer_name(sbx) not in host_mounts()
        assert os.listdir(sbx.host.path / LAYER_DIR) == []  # the host's side: an empty mount point
        host_files = [p for p in sbx.host.path.rglob("*") if p.is_file()]
        assert all(marker.encode() not in p.read_bytes() for p in host_files)
    assert not sbx.host.path.exists()
    # the reaper: a sandbox past its TTL whose watchdog is gone (its processes
    # hold the layer; the leftovers check after the test looks for them)
    with Sandbox.create(driver=driver_name, ttl_seconds=180, memory_mb=MEMORY_MB) as sbx:
        watchdog = sbx.watchdog
        assert watchdog is not None
        watchdog.kill()
        watchdog.wait(timeout=10)
        sbx.host.extend_deadline(-60)
        wait_until(lambda: sbx.id in ProcessDriver(data_dir).reap(), timeout=30, message="the reaper")
        assert not sbx.host.path.exists()
