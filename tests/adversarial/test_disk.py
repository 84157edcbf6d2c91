"""Rule H3 and guarantee 1: a job that fills its scratch space gets ENOSPC
at the quota (the work dir's `--work-mb`, /tmp 64 MiB), and statvfs shows the quota,
not the host's disk; /dev/shm is the sandbox's own, not the host's; a 1 TiB
sparse file costs the host nothing. And nothing the sandbox can statvfs
tells it about the host's disks."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.adversarial.harness import Arena

MIB = 1 << 20
WORK_MB = 48  # `--work-mb`: the quota must follow the flag, not the default
QUOTAS = {"/tenantq/work": WORK_MB * MIB, "/tmp": 64 * MIB}
# pseudo filesystems whose statvfs says nothing about a disk
PSEUDO = ("/proc", "/sys", "/dev")


def host_disks(*paths: Path | str) -> dict[int, str]:
    """Total size -> a path, for every host filesystem the sandbox's
    read-only mounts and data dir come from."""
    out: dict[int, str] = {}
    for path in paths:
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        if st.f_blocks:
            out.setdefault(st.f_blocks * st.f_frsize, str(path))
    return out


@pytest.fixture
def host_shm_marker() -> Iterator[str]:
    name = f"tenantq-adversarial-{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / name
    path.write_text("host /dev/shm")
    try:
        yield name
    finally:
        path.unlink(missing_ok=True)


def run_disk_job(arena: Arena, shm_name: str, *extra: str) -> dict[str, Any] | None:
    arena.neighbour(1)
    job = arena.attack("adv.disk", {"host_shm_name": shm_name})
    arena.sibling(2)
    arena.neighbour(3)
    before = set(os.listdir("/dev/shm"))
    arena.run("--concurrency", "2", "--batch-size", "2", *extra, timeout=150)
    added = set(os.listdir("/dev/shm")) - before
    arena.expect(not added, f"the host's /dev/shm got new entries while the sandbox ran: {sorted(added)}")
    status, _, report, error = arena.outcome(job)
    arena.expect(status == "done", f"adv.disk did not report: {status} {error[:600]}")
    return report if status == "done" else None


def test_scratch_space_is_a_small_quota(arena: Arena, host_shm_marker: str) -> None:
    report = run_disk_job(arena, host_shm_marker, "--work-mb", str(WORK_MB))
    if report is not None:
        disks = host_disks("/", arena.tmp, sys.prefix, Path(__file__).parent)
        for directory, quota in QUOTAS.items():
            seen = report[directory]
            arena.expect(seen["error"] == "ENOSPC", f"rule H3: filling {directory} ended with "
                                                    f"{seen['error']} after {seen['written']} bytes")
            arena.expect(seen["written"] <= quota + MIB,
                         f"rule H3: {directory} took {seen['written']} bytes (quota {quota})")
            st = report["statvfs"].get(directory)
            arena.expect(isinstance(st, dict) and 0 < st["total"] <= quota + MIB and st["total"] not in disks,
                         f"rule H3: statvfs({directory}) shows {st} (quota {quota}; host disks {disks})")
        arena.expect(not report["host_shm_marker_visible"],
                     f"the host's /dev/shm is the sandbox's: it sees {host_shm_marker}")
    arena.verdict()


def test_statvfs_of_writable_mounts_shows_only_quotas(arena: Arena, host_shm_marker: str) -> None:
    """Guarantee 1 (docs/security.md): what a job can write shows its quota in
    statvfs, never the host disk; the read-only mounts are host directories
    and say so (their statvfs is the host filesystem's), but take no write."""
    report = run_disk_job(arena, host_shm_marker)
    if report is not None:
        disks = host_disks("/", arena.tmp, sys.prefix, Path(__file__).parent, Path(os.__file__).parent)
        for mount, st in report["statvfs"].items():
            if mount.startswith(PSEUDO) or not isinstance(st, dict):
                continue
            if mount in QUOTAS:
                arena.expect(st["total"] not in disks,
                             f"guarantee 1: statvfs({mount}) reports the host disk {disks.get(st['total'])}")
            else:
                arena.expect(st.get("readonly", True),
                             f"guarantee 1: {mount} is a host directory the job can write to: {st}")
    arena.verdict()
