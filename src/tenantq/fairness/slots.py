"""Priority classes across a worker's slots: strict priority plus a
reservation for `interactive` that is lent out when unused.

- Every slot tries `interactive`, then `default`, then `bulk`, so
  interactive work is never queued behind bulk work.
- The first `reserved_slots()` slots (at least `share` of the slots, at
  least one) belong to interactive. While interactive has nothing runnable
  they are lent to the other classes (work-conserving), but a lent batch is
  recalled as soon as interactive work appears: it finishes the job it is
  running, releases its unstarted jobs (attempts refunded), and the slot
  goes back to interactive. So interactive work waits at most one running
  job for its reserved share, not one whole batch.
"""

from __future__ import annotations

import math

from tenantq.domain.records import PRIORITIES, Priority

DEFAULT_INTERACTIVE_SHARE = 0.3


def reserved_slots(concurrency: int, share: float = DEFAULT_INTERACTIVE_SHARE) -> int:
    """Slots reserved for interactive: ceil(share * concurrency), at least one
    (unless share is 0), at most all of them."""
    if not 0 <= share <= 1:
        raise ValueError(f"interactive share must be between 0 and 1, got {share}")
    if share == 0 or concurrency <= 0:
        return 0
    return min(concurrency, max(1, math.ceil(concurrency * share)))


def class_order() -> tuple[Priority, ...]:
    """The order every slot tries the classes in (strict priority)."""
    return PRIORITIES


def is_lent(slot: int, priority: Priority, reserved: int) -> bool:
    """A reserved slot running non-interactive work is on loan and may be recalled."""
    return slot < reserved and priority != "interactive"
