"""`tenantq reap` for sandboxes: every driver that works here reaps what is
past its TTL (workers run the same per driver on their own)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from pathlib import Path

from tenantq.sandbox import code_view
from tenantq.sandbox.drivers import bwrap_works, runsc_works
from tenantq.sandbox.layout import CODE_DIR

# a copy of the app's code unused this long is removed (a kept-warm sandbox
# lives at most a day on the copy it was made with)
CODE_COPY_SECONDS = 2 * 86400.0


def reap_sandboxes(data_dir: Path) -> list[str]:
    from tenantq.sandbox.drivers.gvisor import GVisorDriver
    from tenantq.sandbox.drivers.process import ProcessDriver
    from tenantq.sandbox.snapshots import SnapshotStore

    gone: list[str] = []
    if runsc_works():
        gone += GVisorDriver(data_dir).reap()
        # unused templates and old hibernated sandboxes (by age only: no
        # worker here says which template is current)
        gone += SnapshotStore(data_dir, GVisorDriver.name).gc()
    if bwrap_works():
        gone += ProcessDriver(data_dir).reap()
    return gone + collect_host_files(data_dir)


def collect_host_files(data_dir: Path, keep: Iterable[Path] = ()) -> list[str]:
    """Copies of the app's code that no worker has used for two days (rule
    M1), and the per-host leaf certificate files tenantq 0.x wrote under
    egress-ca/ (now made in memory: rule E3)."""
    removed = [f"code copy {p.name}" for p in code_view.collect(
        data_dir / CODE_DIR, {*keep, data_dir / CODE_DIR / "masks"}, older_than=CODE_COPY_SECONDS,
        now=time.time())]
    for leaf in (data_dir / "egress-ca").glob("*/leaf-*.pem"):
        with contextlib.suppress(OSError):
            leaf.unlink()
            removed.append(f"leaf certificate file {leaf.name}")
    return removed
