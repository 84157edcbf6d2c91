"""`tenantq reap` for sandboxes: every driver that works here reaps what is
past its TTL (workers run the same per driver on their own)."""

from __future__ import annotations

from pathlib import Path

from tenantq.sandbox.driver import bwrap_works, runsc_works


def reap_sandboxes(data_dir: Path) -> list[str]:
    from tenantq.sandbox.gvisor import GVisorDriver
    from tenantq.sandbox.process import ProcessDriver

    gone: list[str] = []
    if runsc_works():
        gone += GVisorDriver(data_dir).reap()
    if bwrap_works():
        gone += ProcessDriver(data_dir).reap()
    return gone
