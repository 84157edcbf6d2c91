"""Where a batch runs. `inline` runs handlers in the dispatcher process (the
trusted shared-fleet path); sandboxed drivers come with the sandbox layer."""

from typing import TYPE_CHECKING, Any

from tenantq.sandbox.executor import BatchExecutor, JobEnded, JobStarted
from tenantq.sandbox.inline import InlineExecutor

if TYPE_CHECKING:
    from tenantq.sandbox.client import Client


def __getattr__(name: str) -> Any:
    if name == "Client":  # `tenantq.sandbox.Client().sandboxes.create(...)`
        from tenantq.sandbox.client import Client

        return Client
    raise AttributeError(f"module 'tenantq.sandbox' has no attribute {name!r}")


__all__ = ["BatchExecutor", "Client", "InlineExecutor", "JobEnded", "JobStarted"]
