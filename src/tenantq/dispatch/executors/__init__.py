"""Where a batch runs: the executor contract (`contract.py`), the `inline`
executor (handlers in the dispatcher process: the trusted shared-fleet
path) and the sandboxed one (`sandboxed.py`: each batch in a Sandbox API
sandbox of its tenant, fed by `session.py`, its sandbox from `warm.py`)."""

from tenantq.dispatch.executors.contract import BatchExecutor, JobEnded, JobStarted
from tenantq.dispatch.executors.inline import InlineExecutor

__all__ = ["BatchExecutor", "InlineExecutor", "JobEnded", "JobStarted"]
