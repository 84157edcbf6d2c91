"""Kinds that ship with tenantq.

`tenantq.python` runs tenant-supplied Python: the payload carries the source
and its input. It only ever runs sandboxed; an inline worker refuses it.

    {"source": "def transform(data):\\n    return sum(data)", "input": [1, 2, 3]}
"""

from __future__ import annotations

from typing import Any

from tenantq.errors import InvalidInput
from tenantq.registry import JobContext, handler

PYTHON_KIND = "tenantq.python"


@handler(PYTHON_KIND, timeout=30, memory_mb=256, isolation="sandbox", sandbox_only=True)
def run_tenant_python(payload: Any, ctx: JobContext) -> Any:
    if not isinstance(payload, dict) or not isinstance(payload.get("source"), str):
        raise InvalidInput('tenantq.python payload must be {"source": "...", "input": ...}')
    namespace: dict[str, Any] = {"__name__": "tenant_code"}
    exec(compile(payload["source"], "<tenant code>", "exec"), namespace)
    transform = namespace.get("transform")
    if not callable(transform):
        raise InvalidInput("tenant code must define transform(input)")
    return transform(payload.get("input"))
