"""`tenantq reap` for sandboxes: every driver that works here reaps what is
past its TTL (workers run the same per driver on their own)."""

from __future__ import annotations

from pathlib import Path

from tenantq.sandbox.drivers import bwrap_works, runsc_works


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
    return gone
