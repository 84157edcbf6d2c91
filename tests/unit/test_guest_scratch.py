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
