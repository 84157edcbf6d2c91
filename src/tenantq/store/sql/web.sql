-- Statements the web dashboard reads. Read-only; nothing here is on the
-- claim path, so plain scans are acceptable where no index fits.

-- name: recent_failures
-- Failed (and lost) attempts, newest first, at the time they failed: from
-- the attempt history, so a job that failed and then succeeded shows its
-- failure, stamped when it happened. The partial indexes attempts_failures
-- (all tenants) and attempts_failures_by_tenant (one) hold only failures,
-- in time order, so the newest %(limit)s are read straight off an index.
-- `error_line` is the first line of the error: the one that says what
-- happened. `status` is the job's status now.
SELECT a.job_id AS id, a.tenant_id, j.kind, j.priority, j.status, a.attempt, a.replay, j.max_attempts,
       a.outcome, a.worker_id, split_part(a.error, E'\n', 1) AS error_line, a.finished_at AS failed_at
FROM attempts a
LEFT JOIN jobs j ON j.id = a.job_id
WHERE a.outcome IN ('failed', 'lost')
  AND (%(tenant_id)s::text IS NULL OR a.tenant_id = %(tenant_id)s)
ORDER BY a.finished_at DESC
LIMIT %(limit)s;

-- name: dead_count
-- How many dead jobs there are (the dead list itself is capped).
SELECT count(*) AS n
FROM jobs
WHERE status = 'dead' AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s);
