"""asyncio: enqueue without a caller's transaction, and wait for results."""

import asyncio
from typing import Any

import tenantq


async def render(queue: tenantq.AsyncQueue, tenant: str, month: int, *, timeout: float = 30
                 ) -> dict[str, Any]:
    job_id = await queue.enqueue(tenant, "reports.render", {"month": month}, priority="interactive")
    try:
        job = await queue.wait(job_id, timeout=timeout)  # woken by the job's end, not by polling
    except tenantq.WaitTimeout:
        await queue.cancel(job_id)  # nobody will read its result: stop it
        raise
    if job.status != "done":  # dead (out of attempts) or cancelled
        raise RuntimeError(f"job {job_id} ended {job.status}: {job.last_error}")
    return job.result


async def quarter(tenant: str) -> list[dict[str, Any]]:
    async with tenantq.AsyncQueue() as queue:  # TENANTQ_DATABASE_URL; one AsyncQueue per event loop
        return await asyncio.gather(*(render(queue, tenant, month) for month in (1, 2, 3)))


if __name__ == "__main__":
    print(asyncio.run(quarter("acme")))
