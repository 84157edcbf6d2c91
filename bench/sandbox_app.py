"""The handler the sandbox benchmark runs (sandboxed by default)."""

from __future__ import annotations

import time
from typing import Any

import tenantq


@tenantq.handler("bench.sleep10", timeout=5, memory_mb=128)
def sleep10(payload: Any, ctx: tenantq.JobContext) -> None:
    time.sleep(0.010)
