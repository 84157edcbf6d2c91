"""tenantq: a multi-tenant job queue on Postgres.

    import tenantq

    @tenantq.handler("reports.render", timeout=60, memory_mb=256)
    def render(payload: dict, ctx: tenantq.JobContext) -> dict:
        return {"pages": 3}

    q = tenantq.Queue()
    job_id = q.enqueue("acme", "reports.render", {"month": 9}, priority="interactive")
    q.job(job_id).status
"""

from tenantq.errors import (
    DatabaseUnavailable,
    InvalidInput,
    JobNotFound,
    LeaseLost,
    TenantqError,
)
from tenantq.queue import JobSpec, Queue
from tenantq.registry import REGISTRY, Handler, JobContext, Registry, handler
from tenantq.store.model import JobInfo

__version__ = "0.1.0"

__all__ = [
    "REGISTRY",
    "DatabaseUnavailable",
    "Handler",
    "InvalidInput",
    "JobContext",
    "JobInfo",
    "JobNotFound",
    "JobSpec",
    "LeaseLost",
    "Queue",
    "Registry",
    "TenantqError",
    "__version__",
    "handler",
]
