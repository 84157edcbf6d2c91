"""tenantq: a multi-tenant job queue on Postgres.

    import tenantq

    @tenantq.handler("reports.render", timeout=60, memory_mb=256)
    def render(payload: dict, ctx: tenantq.JobContext) -> dict:
        return {"pages": 3}

    q = tenantq.Queue()
    job_id = q.enqueue("acme", "reports.render", {"month": 9}, priority="interactive")
    q.job(job_id).status
"""

from typing import TYPE_CHECKING, Any

from tenantq import builtins as builtins  # registers tenantq.python
from tenantq.domain.records import JobInfo
from tenantq.errors import (
    DatabaseUnavailable,
    HostFunctionError,
    InvalidInput,
    JobNotFound,
    LeaseLost,
    NoAppDatabase,
    TenantqError,
    WaitTimeout,
)
from tenantq.host_functions import HostContext, host_function
from tenantq.registry import REGISTRY, Handler, JobContext, Registry, handler, periodic, warmup

if TYPE_CHECKING:
    from tenantq.queue import AsyncQueue, JobSpec, Queue
    from tenantq.sandbox.aio import AsyncSandbox
    from tenantq.sandbox.api import Sandbox


def __getattr__(name: str) -> Any:
    # Queue pulls in psycopg; importing it lazily keeps `import tenantq`
    # cheap and dependency-free inside a sandbox, where handlers only need
    # the decorator and JobContext.
    if name in ("Queue", "AsyncQueue", "JobSpec"):
        from tenantq import queue

        return getattr(queue, name)
    if name == "Sandbox":
        from tenantq.sandbox.api import Sandbox

        return Sandbox
    if name == "AsyncSandbox":
        from tenantq.sandbox.aio import AsyncSandbox

        return AsyncSandbox
    raise AttributeError(f"module 'tenantq' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "REGISTRY",
    "AsyncQueue",
    "AsyncSandbox",
    "DatabaseUnavailable",
    "Handler",
    "HostContext",
    "HostFunctionError",
    "InvalidInput",
    "JobContext",
    "JobInfo",
    "JobNotFound",
    "JobSpec",
    "LeaseLost",
    "NoAppDatabase",
    "Queue",
    "Registry",
    "Sandbox",
    "TenantqError",
    "WaitTimeout",
    "__version__",
    "handler",
    "host_function",
    "periodic",
    "warmup",
]
