"""A Sandbox API sandbox's TTL, enforced from the host: one small detached
process per sandbox (`python -m tenantq.sandbox.watchdog DRIVER DATA_DIR ID`)
that reads the deadline from the host's own metadata file and, once it has
passed, destroys the sandbox (its container or namespaces, cgroups, mounts
and directory), then exits; it exits too as soon as the sandbox is gone.

The agent ends the sandbox at the deadline as well, but the agent is the
guest's: a command can stop it (SIGSTOP to pid 1 under gVisor) or make it
block. The watchdog is not reachable from inside, outlives the process that
made the sandbox (its own session), and follows `set_ttl` from any process
(it rereads the file). docs/security.md, rule S1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHECK_SECONDS = 1.0


def start(driver: str, data_dir: Path, sandbox_id: str) -> subprocess.Popen[bytes]:
    """Start the watchdog of a sandbox just made (returns at once)."""
    argv = [sys.executable, "-m", "tenantq.sandbox.watchdog", driver, str(data_dir), sandbox_id]
    return subprocess.Popen(argv,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def stop(pid: int, sandbox_id: str) -> None:
    """End a sandbox's watchdog (its sandbox is being deleted): only if that
    pid is still this sandbox's watchdog, not a process that reused it."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return
    if b"tenantq.sandbox.watchdog" in cmdline and sandbox_id.encode() in cmdline:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    from tenantq.sandbox.hostside import read_meta

    driver_name, data_dir, sandbox_id = argv
    path = Path(data_dir) / "sandboxes" / driver_name / sandbox_id
    while True:
        meta = read_meta(path)
        if meta is None:
            return 0  # deleted (or never finished): nothing to watch
        try:
            remaining = float(str(meta["deadline"])) - time.time()
        except (KeyError, ValueError):
            remaining = 0.0
        if remaining <= 0:
            from tenantq.sandbox.drivers import get_driver

            driver, _ = get_driver(driver_name, Path(data_dir))
            driver.adopt(sandbox_id, path, meta).destroy()  # type: ignore[attr-defined]
            return 0
        time.sleep(min(remaining, CHECK_SECONDS))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
