-- Statements the web dashboard reads. Read-only; nothing here is on the
-- claim path, so plain scans are acceptable where no index fits.

-- name: recent_failures
-- Jobs whose last attempt (or an earlier one) failed, newest failure first.
-- There is no index on last_error on purpose (it would be written on every
-- failure to serve one dashboard query); the sort key is the last moment the
-- job was touched, and LIMIT keeps the result small. `error_line` is the
-- first line of the error: the one that says what happened.
SELECT id, tenant_id, kind, priority, status, attempts, max_attempts,
       split_part(last_error, E'\n', 1) AS error_line,
       coalesce(finished_at, started_at, created_at) AS failed_at
FROM jobs
WHERE last_error IS NOT NULL
  AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s)
ORDER BY coalesce(finished_at, started_at, created_at) DESC, id DESC
LIMIT %(limit)s;

-- name: dead_count
-- How many dead jobs there are (the dead list itself is capped).
SELECT count(*) AS n
FROM jobs
WHERE status = 'dead' AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s);
