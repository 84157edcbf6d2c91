-- Statements about batches (leases). A live lease is a row with
-- ended_at IS NULL and lease_expires_at in the future; occupancy of a tenant
-- is counted from live leases, never from a counter that could leak.

-- name: lock_live
-- Taken at the start of every settle. FOR UPDATE makes the reaper's
-- expire statement wait for the settle (and then see ended_at or the jobs'
-- new states) instead of interleaving with it.
SELECT batch_id FROM batches
WHERE batch_id = %(batch_id)s AND ended_at IS NULL
  AND lease_expires_at > coalesce(%(now)s::timestamptz, now())
FOR UPDATE;

-- name: heartbeat
-- Extend every live lease of one worker in one statement; a lease that has
-- already expired is NOT revived (its jobs may be re-leased by now), so it is
-- missing from the result and the worker treats it as lost (see ended_by_slot).
UPDATE batches
SET lease_expires_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(lease_seconds)s),
    heartbeat_at = coalesce(%(now)s::timestamptz, now())
WHERE batch_id = ANY(%(batch_ids)s::bigint[]) AND ended_at IS NULL
  AND lease_expires_at > coalesce(%(now)s::timestamptz, now())
RETURNING batch_id;

-- name: ended_by_slot
-- Of the batches the heartbeat did not extend, those their own slot ended
-- meanwhile: finished, not lost. A statement of its own, so a new snapshot
-- (READ COMMITTED) sees an end that committed while the heartbeat waited on
-- the row's lock.
SELECT batch_id FROM batches
WHERE batch_id = ANY(%(batch_ids)s::bigint[]) AND outcome IN ('ok', 'failed', 'released');

-- name: end
UPDATE batches
SET ended_at = coalesce(%(now)s::timestamptz, now()), outcome = %(outcome)s,
    run_seconds = %(run_seconds)s, egress = %(egress)s, host_calls = %(host_calls)s
WHERE batch_id = %(batch_id)s AND ended_at IS NULL;

-- name: set_charged
UPDATE batches SET charged_seconds = %(seconds)s WHERE batch_id = %(batch_id)s;

-- name: expire
-- The reaper: end every lease past its expiry and put its unsettled jobs
-- back. The attempt the claim counted stays counted (a crash counts), so a
-- job that keeps killing its dispatcher still reaches `dead`.
-- If a settle holds the batch row, this waits for it and then rechecks the
-- row (READ COMMITTED re-evaluation), so a just-settled job is left alone.
-- Each job's attempt is recorded as `lost` in the same statement.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), expired AS (
    UPDATE batches b
    SET ended_at = clock.now, outcome = 'lease_expired'
    FROM clock
    WHERE b.ended_at IS NULL AND b.lease_expires_at <= clock.now
    RETURNING b.batch_id, b.worker_id, b.sandbox_driver, b.created_at
), reaped AS (
    UPDATE jobs j
    -- a job asked to stop (`tenantq cancel` while it ran) ends cancelled:
    -- its worker died before it could, and it must not run again
    SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                      WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'pending' END,
        batch_id = NULL,
        run_after = clock.now,
        last_error = 'lease expired: worker ' || e.worker_id || ' stopped heartbeating mid-batch',
        finished_at = CASE WHEN j.cancel_requested_at IS NOT NULL OR j.attempts >= j.max_attempts
                           THEN clock.now END
    FROM expired e, clock
    WHERE j.batch_id = e.batch_id AND j.status = 'running'
    RETURNING j.id, j.tenant_id, j.priority, j.status, j.run_after, j.kind, j.attempts, j.last_error,
              j.replays, coalesce(j.started_at, e.created_at) AS started_at, e.worker_id, e.sandbox_driver
), recorded AS (
    INSERT INTO attempts (tenant_id, job_id, attempt, replay, started_at, finished_at, worker_id, driver,
                          outcome, error)
    SELECT r.tenant_id, r.id, greatest(r.attempts, 1), r.replays, least(r.started_at, clock.now), clock.now,
           r.worker_id, r.sandbox_driver, 'lost', r.last_error
    FROM reaped r, clock
), ended AS (
    -- jobs out of attempts died: wake their waiters at commit (see jobs.sql `settle`)
    SELECT pg_notify(left('tenantq_done_' || current_schema(), 63),
                     CASE WHEN length(ids) <= 7900 THEN ids ELSE '*' END)
    FROM (SELECT string_agg(id::text, ',') AS ids FROM reaped WHERE status IN ('dead', 'cancelled')) AS d
    WHERE ids IS NOT NULL
)
SELECT id, tenant_id, priority, status, run_after, kind, attempts, last_error
FROM reaped, (SELECT count(*) FROM ended) AS notified;

-- name: live_for_tenant
SELECT count(*) AS n FROM batches
WHERE tenant_id = %(tenant_id)s AND ended_at IS NULL
  AND lease_expires_at > coalesce(%(now)s::timestamptz, now());

-- name: live
SELECT batch_id, tenant_id, priority, worker_id, sandbox_driver, job_count,
       created_at, heartbeat_at, lease_expires_at,
       extract(epoch FROM now() - created_at)::double precision AS age_seconds
FROM batches
WHERE ended_at IS NULL
ORDER BY created_at;

-- name: prune
-- Ended batches are kept for TENANTQ_RETAIN_BATCHES as a record, then
-- deleted oldest first, %(limit)s per statement (each its own short
-- transaction, through batches_ended), so pruning a day of batches never
-- holds many locks at once. Their egress-block rows go with them (ON DELETE
-- CASCADE); their jobs ended long before (a job's batch_id is cleared when
-- it settles).
DELETE FROM batches
WHERE batch_id IN (
    SELECT batch_id FROM batches
    WHERE ended_at < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(keep_seconds)s)
    ORDER BY ended_at
    LIMIT %(limit)s
);
