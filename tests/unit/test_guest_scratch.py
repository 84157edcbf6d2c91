"""What the guest empties before every job (rule P1): everything, but the
way to the mount points of read-only code under /tmp; links are removed,
never followed."""

from __future__ import annotations

import os
from pathlib import Path

from tenantq.guest.scratch import _empty


def test_everything_goes_but_the_way_to_kept_mount_points(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep-me").write_text("host file")
    tmp = tmp_path / "tmp"
    (tmp / "pytest-of-root" / "app").mkdir(parents=True)
    (tmp / "pytest-of-root" / "left-behind").write_text("x")
    (tmp / "pytest-of-root" / "dir-left").mkdir()
    (tmp / "file").write_text("x")
    (tmp / "deep" / "er").mkdir(parents=True)
    os.symlink(outside, tmp / "link-to-outside")
    os.symlink(outside / "keep-me", tmp / "pytest-of-root" / "link")
    os.mkfifo(tmp / "fifo")
    keep = {str(tmp / "pytest-of-root" / "app")}
    _empty(str(tmp), keep)
    assert sorted(p.name for p in tmp.iterdir()) == ["pytest-of-root"]
    assert sorted(p.name for p in (tmp / "pytest-of-root").iterdir()) == ["app"]
    assert (outside / "keep-me").read_text() == "host file", "a link was followed"


def test_deep_and_locked_trees_are_removed(tmp_path: Path) -> None:
    top = tmp_path / "tmp"
    top.mkdir()
    # 2,500 levels: deeper than Python's recursion limit and than PATH_MAX
    fd = os.open(top, os.O_RDONLY)
    for _ in range(2500):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as fh:
        fh.write("x")
    os.close(fd)
    for mode in (0o000, 0o100, 0o500):
        locked = top / f"locked-{mode:o}"
        (locked / "inner").mkdir(parents=True)
        (locked / "inner" / "file").write_text("x")
        os.chmod(locked / "inner", mode)
        os.chmod(locked, mode)
    _empty(str(top), set())
    assert list(top.iterdir()) == []
