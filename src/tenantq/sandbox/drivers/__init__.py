"""The sandbox drivers (gvisor.py, process.py), and choosing one.

The contract they implement is sandbox/driver.py, which imports none of
them: a driver depends on the contract, never the other way round.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

from tenantq.errors import InvalidInput
from tenantq.sandbox.driver import SandboxDriver


@functools.cache
def runsc_works() -> bool:
    """Is runsc installed and able to run a container here? (Asked once per
    process: it runs a command, and a Sandbox.create from the pool must not.)"""
    if shutil.which("runsc") is None:
        return False
    try:
        subprocess.run(["runsc", "--version"], capture_output=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


@functools.cache
def bwrap_works() -> bool:
    if shutil.which("bwrap") is None:
        return False
    try:
        subprocess.run(["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--ro-bind", "/usr",
                        "/usr", "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/lib", "/lib",
                        "/usr/bin/true"],
                       capture_output=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def get_driver(name: str, data_dir: Path) -> tuple[SandboxDriver, str]:
    """The driver for `--sandbox NAME`, and a sentence saying what was chosen."""
    from tenantq.sandbox.drivers.gvisor import GVisorDriver
    from tenantq.sandbox.drivers.process import ProcessDriver

    if name == "auto":
        if runsc_works():
            return GVisorDriver(data_dir), "sandbox auto: chose gvisor (runsc works here)"
        if bwrap_works():
            return ProcessDriver(data_dir), (
                "sandbox auto: chose process (runsc is not available; bubblewrap is)")
        raise InvalidInput("sandbox auto: neither runsc nor bubblewrap works here; install one, "
                           "or use --sandbox inline for trusted code only")
    if name == "gvisor":
        if not runsc_works():
            raise InvalidInput(
                "sandbox gvisor: runsc is not installed or does not work (apt-get install runsc)")
        return GVisorDriver(data_dir), "sandbox gvisor"
    if name == "process":
        if not bwrap_works():
            raise InvalidInput("sandbox process: bubblewrap does not work here (apt-get install bubblewrap)")
        return ProcessDriver(data_dir), "sandbox process (bubblewrap; weaker isolation than gvisor)"
    raise InvalidInput(f"unknown sandbox driver {name!r}: use auto, gvisor, process or inline")
