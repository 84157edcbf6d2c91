"""Which tenant runs next: the scheduler's pick, global across dispatchers."""

from tenantq.fairness.picker import ClaimRequest, PickNotes, claim_next

__all__ = ["ClaimRequest", "PickNotes", "claim_next"]
