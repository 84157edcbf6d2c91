"""The egress benchmark's app: time HTTP GETs from inside a sandbox."""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import tenantq


@tenantq.handler("egressbench.gets", timeout=120, memory_mb=128)
def gets(payload: dict[str, Any], ctx: tenantq.JobContext) -> list[float]:
    out = []
    for _ in range(int(payload["n"])):
        t0 = time.perf_counter()
        with urllib.request.urlopen(payload["url"], timeout=10) as resp:
            resp.read()
        out.append(time.perf_counter() - t0)
    return out
