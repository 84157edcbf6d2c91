-- Statements about egress: refused requests of sandboxed batches.

-- name: record_blocks
-- Written with the end of the batch, in the settle transaction; the tenant
-- is the batch's (never taken from what the sandbox reported).
INSERT INTO egress_blocks (tenant_id, batch_id, job_id, host, reason, blocked_at)
-- `at` is NULL when it was not a usable time (jobs.py checks it): the
-- batch's clock stands in.
SELECT b.tenant_id, b.batch_id, r.job_id, r.host, r.reason,
       coalesce(to_timestamp(r.at), coalesce(%(now)s::timestamptz, now()))
FROM batches b,
     unnest(%(job_ids)s::bigint[], %(hosts)s::text[], %(reasons)s::text[], %(ats)s::double precision[])
         AS r(job_id, host, reason, at)
WHERE b.batch_id = %(batch_id)s;

-- name: for_job
SELECT e.host, e.reason, e.blocked_at, e.batch_id
FROM egress_blocks e JOIN jobs j ON j.tenant_id = e.tenant_id AND j.id = e.job_id
WHERE j.id = %(job_id)s
ORDER BY e.blocked_at, e.id
LIMIT 50;
