"""Exceptions with messages meant to be shown to a user as one line."""

from __future__ import annotations


class TenantqError(Exception):
    """Base class for every error tenantq raises on purpose."""


class InvalidInput(TenantqError, ValueError):
    """Bad input (tenant id, kind, payload, option); nothing was written."""


class JobNotFound(TenantqError, LookupError):
    """No job with that id."""


class LeaseLost(TenantqError):
    """A settle or heartbeat carried a fencing token that is no longer live."""


class DatabaseUnavailable(TenantqError):
    """The configured database cannot be reached."""


class WaitTimeout(TenantqError, TimeoutError):
    """`Queue.wait` gave up: the job had not ended within the timeout."""


class NoAppDatabase(TenantqError):
    """`ctx.db()` on a worker without an application database, or in a sandbox."""


class HostFunctionError(TenantqError):
    """`ctx.call(name, args)` failed: refused, unknown, over a limit, or raised on the host."""
