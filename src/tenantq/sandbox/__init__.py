"""Where a batch runs. `inline` runs handlers in the dispatcher process (the
trusted shared-fleet path); sandboxed drivers come with the sandbox layer."""

from tenantq.sandbox.executor import BatchExecutor, JobEnded, JobStarted
from tenantq.sandbox.inline import InlineExecutor

__all__ = ["BatchExecutor", "InlineExecutor", "JobEnded", "JobStarted"]
