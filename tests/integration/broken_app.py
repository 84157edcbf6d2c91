"""An app whose handler's warmup always fails: `tenantq worker --app
tests.integration.broken_app` in a subprocess (never imported by the test
process, whose registry it would change)."""

from __future__ import annotations

from typing import Any

import tenantq


def prepare() -> None:
    raise RuntimeError("the model file is missing")


@tenantq.handler("broken.job", isolation="inline", warmup="tests.integration.broken_app:prepare")
def broken_job(payload: Any, ctx: tenantq.JobContext) -> None:
    return None
