-- Statements about jobs. `%(now)s` is NULL in production (the database
-- clock, shared by every dispatcher) and a fixed time in tests.

-- name: insert
-- One round trip for one job or thousands: every column arrives as an array
-- and unnest() turns them into rows. The CTEs run as one statement, so the
-- tenant rows, the queue wake-up and the jobs commit together.
--
-- Lock order: tenants, then queues, both in sorted order, so two bulk
-- enqueues that touch the same tenants cannot deadlock. The queue upsert
-- locks its row even when its WHERE makes it a no-op; that lock is what the
-- scheduler's "is this queue empty?" check waits on (see queues.sql).
--
-- Rows are inserted in input order (ORDER BY ord), so identity values come
-- back ascending in input order; rows skipped by an idempotency-key conflict
-- are looked up afterwards by key.
WITH input AS (
    SELECT *
    FROM unnest(
        %(tenant_ids)s::text[], %(kinds)s::text[], %(payloads)s::jsonb[], %(priorities)s::text[],
        %(max_attempts)s::integer[], %(delays)s::double precision[], %(keys)s::text[]
    ) WITH ORDINALITY AS i(tenant_id, kind, payload, priority, max_attempts, delay, idempotency_key, ord)
), clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), new_tenants AS (
    INSERT INTO tenants (tenant_id)
    SELECT DISTINCT tenant_id FROM input ORDER BY tenant_id
    ON CONFLICT (tenant_id) DO NOTHING
), woken AS (
    INSERT INTO queues AS q (tenant_id, priority, has_work, next_run_at)
    SELECT tenant_id, priority, true, min(clock.now + make_interval(secs => delay))
    FROM input, clock
    GROUP BY tenant_id, priority
    ORDER BY tenant_id, priority
    ON CONFLICT (tenant_id, priority) DO UPDATE
        SET has_work = true, next_run_at = least(q.next_run_at, excluded.next_run_at)
        WHERE NOT q.has_work OR q.next_run_at > excluded.next_run_at
), inserted AS (
    INSERT INTO jobs (tenant_id, kind, payload, priority, max_attempts, run_after, idempotency_key, created_at)
    SELECT i.tenant_id, i.kind, i.payload, i.priority, i.max_attempts,
           clock.now + make_interval(secs => i.delay), i.idempotency_key, clock.now
    FROM input i, clock
    ORDER BY i.ord
    ON CONFLICT (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, tenant_id, idempotency_key
), wake_listeners AS (
    -- delivered at commit, so a woken worker already sees the jobs; one
    -- notification per statement
    -- the payload tells workers whether interactive work arrived, which
    -- recalls slots lent out of the interactive reservation
    SELECT pg_notify(%(channel)s,
                     CASE WHEN EXISTS (SELECT 1 FROM input WHERE priority = 'interactive')
                          THEN 'interactive' ELSE '' END)
    FROM (SELECT 1 FROM inserted LIMIT 1) AS any_inserted
)
SELECT id, tenant_id, idempotency_key
FROM inserted, (SELECT count(*) FROM wake_listeners) AS fired
ORDER BY id;

-- name: ids_by_key
SELECT id, tenant_id, idempotency_key
FROM jobs
WHERE (tenant_id, idempotency_key) IN (
    SELECT * FROM unnest(%(tenant_ids)s::text[], %(keys)s::text[])
);

-- name: notify
SELECT pg_notify(%(channel)s, '');

-- name: claim
-- Lease up to %(limit)s runnable jobs of ONE tenant and class, oldest first.
-- FOR UPDATE SKIP LOCKED: rows another transaction holds (a concurrent
-- claim, cancel or dead-letter replay) are passed over instead of waited
-- on. `picked` is MATERIALIZED so the locked set is computed exactly once;
-- the batch row is only inserted when something was picked (HAVING), and its
-- identity value is the fencing token every later settle must present.
-- The attempt is counted here, at lease time, so a crash still counts.
-- The payload comes back as text: jobs.py decodes it itself, so a stored
-- payload Python cannot decode (nested too deeply) fails that one job
-- instead of aborting the claim in the driver's jsonb loader.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), picked AS MATERIALIZED (
    SELECT j.id
    FROM jobs j, clock
    WHERE j.tenant_id = %(tenant_id)s
      AND j.priority = %(priority)s
      AND j.status = 'pending'
      AND j.run_after <= clock.now
    ORDER BY j.run_after, j.id
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
), batch AS (
    INSERT INTO batches (tenant_id, priority, worker_id, sandbox_driver, job_count,
                         lease_expires_at, created_at, heartbeat_at)
    SELECT %(tenant_id)s, %(priority)s, %(worker_id)s, %(driver)s, count(*),
           min(clock.now) + make_interval(secs => %(lease_seconds)s), min(clock.now), min(clock.now)
    FROM picked, clock
    HAVING count(*) > 0
    RETURNING batch_id, lease_expires_at
)
UPDATE jobs j
SET status = 'running', batch_id = b.batch_id, attempts = j.attempts + 1, started_at = clock.now
FROM picked p, batch b, clock
WHERE j.id = p.id
RETURNING j.id, j.tenant_id, j.kind, j.payload::text AS payload_text, j.priority, j.attempts,
          j.max_attempts, b.batch_id, b.lease_expires_at,
          -- isfinite: a run_after of '-infinity' (written by hand) cannot be subtracted
          CASE WHEN isfinite(j.run_after)
               THEN greatest(extract(epoch FROM clock.now - j.run_after), 0)::double precision
               ELSE 0::double precision END AS waited;

-- name: settle
-- Apply each job's outcome, but only while the job still runs under the
-- presenting lease (batch_id = fencing token AND status = 'running'): a
-- zombie whose lease was reaped and re-leased matches no row. Jobs that go
-- back to pending (retries) wake their queue in the same statement (see the
-- has_work protocol in queues.sql).
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), outcome AS (
    SELECT *
    FROM unnest(%(ids)s::bigint[], %(statuses)s::text[], %(results)s::jsonb[], %(errors)s::text[],
                %(delays)s::double precision[]) AS o(id, status, result, error, delay)
), settled AS (
    UPDATE jobs j
    SET status = o.status,
        result = CASE WHEN o.status = 'done' THEN coalesce(o.result, 'null'::jsonb) ELSE j.result END,
        last_error = coalesce(o.error, j.last_error),
        batch_id = NULL,
        run_after = CASE WHEN o.status = 'pending' THEN clock.now + make_interval(secs => o.delay)
                         ELSE j.run_after END,
        finished_at = CASE WHEN o.status IN ('done', 'dead') THEN clock.now END
    FROM outcome o, clock
    WHERE j.id = o.id AND j.batch_id = %(batch_id)s AND j.status = 'running'
    RETURNING j.id, j.tenant_id, j.priority, j.status, j.run_after
), woken AS (
    INSERT INTO queues AS q (tenant_id, priority, has_work, next_run_at)
    SELECT tenant_id, priority, true, min(run_after) FROM settled
    WHERE status = 'pending'
    GROUP BY tenant_id, priority
    ON CONFLICT (tenant_id, priority) DO UPDATE
        SET has_work = true, next_run_at = least(q.next_run_at, excluded.next_run_at)
        WHERE NOT q.has_work OR q.next_run_at > excluded.next_run_at
)
SELECT id, status FROM settled;

-- name: release_unstarted
-- Jobs of a batch that never started go back without losing the attempt
-- that the claim counted, and wake their queue.
WITH released AS (
    UPDATE jobs
    SET status = 'pending', batch_id = NULL, attempts = attempts - 1, started_at = NULL
    WHERE batch_id = %(batch_id)s AND status = 'running' AND id = ANY(%(ids)s::bigint[])
    RETURNING id, tenant_id, priority, run_after
), woken AS (
    INSERT INTO queues AS q (tenant_id, priority, has_work, next_run_at)
    SELECT tenant_id, priority, true, min(run_after) FROM released
    GROUP BY tenant_id, priority
    ON CONFLICT (tenant_id, priority) DO UPDATE
        SET has_work = true, next_run_at = least(q.next_run_at, excluded.next_run_at)
        WHERE NOT q.has_work OR q.next_run_at > excluded.next_run_at
)
SELECT id FROM released;

-- name: get
SELECT j.*, b.worker_id AS lease_owner, b.lease_expires_at
FROM jobs j
LEFT JOIN batches b ON b.batch_id = j.batch_id
WHERE j.id = %(id)s;

-- name: cancel
UPDATE jobs
SET status = 'cancelled', finished_at = coalesce(%(now)s::timestamptz, now())
WHERE id = %(id)s AND status = 'pending'
RETURNING id;

-- name: dead_list
SELECT id, tenant_id, kind, priority, attempts, max_attempts, last_error, finished_at
FROM jobs
WHERE status = 'dead' AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s)
ORDER BY finished_at DESC, id DESC
LIMIT %(limit)s;

-- name: retry_dead
-- Replay dead jobs: back to pending with a fresh set of attempts. The last
-- error is kept for the record until the next attempt overwrites it.
-- SKIP LOCKED so a replay never waits on a row some other statement holds.
WITH target AS (
    SELECT id FROM jobs
    WHERE status = 'dead'
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
      AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s)
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs j
SET status = 'pending', attempts = 0, finished_at = NULL, started_at = NULL,
    run_after = coalesce(%(now)s::timestamptz, now())
FROM target t
WHERE j.id = t.id
RETURNING j.id, j.tenant_id, j.priority, j.status, j.run_after;

-- name: status_counts
-- Per tenant and class. Counting is a scan of the tenant's rows; the
-- dashboard and `tenantq status` call it, the claim path never does.
SELECT tenant_id, priority,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'pending' AND run_after <= now()) AS runnable,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
       extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::double precision
           AS oldest_pending_seconds
FROM jobs
WHERE %(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s
GROUP BY tenant_id, priority
ORDER BY tenant_id, priority;
