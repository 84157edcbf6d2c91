"""Handlers for the warm-start tests: a warmup that imports and builds state
in the sandbox parent, and jobs that inspect or pollute what they inherit."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid
from typing import Any

import tenantq
from tests.apps import hostile  # noqa: F401  (box.segfault, box.spin, box.alloc: failures a warm sandbox must not survive)

STATE: dict[str, Any] = {}
WARMUPS = {"count": 0}


def prepare() -> None:
    """Imports and state a template should capture (and a cold boot rebuilds)."""
    import decimal
    import email.parser
    import json
    import sqlite3
    import xml.etree.ElementTree

    WARMUPS["count"] += 1
    STATE.update(boot=uuid.uuid4().hex, warmed_at=time.time(), pid=os.getpid(),
                 modules=[m.__name__ for m in (decimal, email.parser, json, sqlite3, xml.etree.ElementTree)])


@tenantq.handler("warm.state", timeout=10, memory_mb=128, warmup="tests.apps.warm:prepare")
def state(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """What this job inherited, and values that must differ between sandboxes."""
    return {"boot": STATE.get("boot"), "warmed_at": STATE.get("warmed_at"), "warmups": WARMUPS["count"],
            "modules_loaded": all(m in sys.modules for m in STATE.get("modules", ["missing"])),
            "urandom": os.urandom(16).hex(), "random": random.random(), "uuid": uuid.uuid4().hex,
            "env": ctx.env.get("TOKEN"), "environ": os.environ.get("TOKEN"), "parent": os.getppid()}


@tenantq.handler("warm.pollute", timeout=10, memory_mb=128)
def pollute(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """Leave every kind of trace a later batch could find."""
    STATE["boot"] = "corrupted"
    STATE["extra"] = "left by an earlier batch"
    os.environ["LEFT_BEHIND"] = "1"
    with open("/tmp/left-behind", "w") as fh:
        fh.write("tmp of an earlier batch")
    os.makedirs("/tmp/dir-left-behind", exist_ok=True)
    with open("left-behind.txt", "w") as fh:  # the work dir
        fh.write("work dir of an earlier batch")
    # a process that outlives the job, and would read the next batch's files
    subprocess.Popen(["/bin/sleep", "300"], start_new_session=True)
    return {"polluted": True}


@tenantq.handler("warm.inspect", timeout=10, memory_mb=128)
def inspect(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
    """What a later batch can see of an earlier one."""
    procs = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    procs.append(fh.read().replace(b"\0", b" ").decode().strip())
            except OSError:
                continue
    return {"boot": STATE.get("boot"), "extra": STATE.get("extra"), "env": os.environ.get("LEFT_BEHIND"),
            "tmp": sorted(os.listdir("/tmp")), "work": sorted(os.listdir(".")),
            "sleepers": [p for p in procs if "sleep" in p]}
