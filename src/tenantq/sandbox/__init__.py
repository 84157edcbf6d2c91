"""Sandboxes: the Sandbox API (`api.py`, `from tenantq import Sandbox`), its
drivers (`drivers/`), templates, the ready pool. The queue's batch
executors, which run on this API, are in `tenantq.dispatch.executors`."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tenantq.sandbox.client import Client


def __getattr__(name: str) -> Any:
    if name == "Client":  # `tenantq.sandbox.Client().sandboxes.create(...)`
        from tenantq.sandbox.client import Client

        return Client
    raise AttributeError(f"module 'tenantq.sandbox' has no attribute {name!r}")


__all__ = ["Client"]
