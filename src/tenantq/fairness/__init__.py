"""Which tenant runs next: the scheduler's pick, global across dispatchers."""

from tenantq.fairness.picker import ClaimRequest, claim_next

__all__ = ["ClaimRequest", "claim_next"]
