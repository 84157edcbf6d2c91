"""Finding jobs and acting on a filtered set: the operations behind
`tenantq jobs` and the dashboard's search (a mixin of Queue and AsyncQueue)."""

from __future__ import annotations


class Finding:
    """Search operations, written as steps like client/operations.py."""
