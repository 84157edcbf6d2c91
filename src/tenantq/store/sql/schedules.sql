-- Statements about schedules (periodic jobs; schema.sql `schedules`).

-- name: upsert
-- Add a schedule, or change the one of that tenant and name. A changed
-- cron or time zone moves its next fire; a paused one stays paused.
INSERT INTO schedules AS s (tenant_id, name, kind, cron, timezone, payload, priority, max_attempts, origin,
                            next_fire_at)
VALUES (%(tenant_id)s, %(name)s, %(kind)s, %(cron)s, %(timezone)s, %(payload)s, %(priority)s, %(max_attempts)s,
        %(origin)s, %(next_fire_at)s)
ON CONFLICT (tenant_id, name) DO UPDATE
    SET kind = excluded.kind, payload = excluded.payload, priority = excluded.priority,
        max_attempts = excluded.max_attempts, origin = excluded.origin,
        next_fire_at = CASE WHEN (s.cron, s.timezone) IS DISTINCT FROM (excluded.cron, excluded.timezone)
                            THEN excluded.next_fire_at ELSE s.next_fire_at END,
        cron = excluded.cron, timezone = excluded.timezone
RETURNING schedule_id, tenant_id, name, kind, cron, timezone, payload, priority, max_attempts, origin,
          paused, next_fire_at, last_fire_at, last_job_id, created_at;

-- name: ensure_tenants
INSERT INTO tenants (tenant_id)
SELECT DISTINCT t FROM unnest(%(tenant_ids)s::text[]) AS t ORDER BY t
ON CONFLICT (tenant_id) DO NOTHING;

-- name: list
SELECT schedule_id, tenant_id, name, kind, cron, timezone, payload, priority, max_attempts, origin,
       paused, next_fire_at, last_fire_at, last_job_id, created_at
FROM schedules
WHERE %(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s
ORDER BY tenant_id, next_fire_at, schedule_id;

-- name: remove
DELETE FROM schedules WHERE schedule_id = %(schedule_id)s RETURNING schedule_id;

-- name: set_paused
-- Returns whether it was paused before (a resume of a running schedule keeps its next fire).
UPDATE schedules s SET paused = %(paused)s
FROM (SELECT schedule_id, paused FROM schedules WHERE schedule_id = %(schedule_id)s FOR UPDATE) AS before
WHERE s.schedule_id = before.schedule_id
RETURNING s.schedule_id, before.paused AS was_paused;

-- name: resume_next_fire
-- A resumed schedule fires next at its next time from now (not for the fires it missed while paused).
UPDATE schedules SET next_fire_at = %(next_fire_at)s WHERE schedule_id = %(schedule_id)s;

-- name: app_schedules
-- The app-declared schedules of these kinds, for a worker to bring in step with its app.
SELECT schedule_id, tenant_id, name FROM schedules
WHERE origin = 'app' AND kind = ANY(%(kinds)s::text[]);

-- name: remove_many
DELETE FROM schedules WHERE schedule_id = ANY(%(ids)s::bigint[]);

-- name: due
-- Due schedules, locked for this transaction. SKIP LOCKED: another worker
-- firing some of them is passed over, not waited on; and a row another
-- worker fired and committed meanwhile is re-checked against the WHERE on
-- its new version (READ COMMITTED), whose next_fire_at is in the future.
-- With the idempotency key of the job, that makes one job per fire time.
SELECT schedule_id, tenant_id, kind, cron, timezone, payload, priority, max_attempts, next_fire_at,
       coalesce(%(now)s::timestamptz, now()) AS now
FROM schedules
WHERE NOT paused AND next_fire_at <= coalesce(%(now)s::timestamptz, now())
ORDER BY next_fire_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED;

-- name: fired
UPDATE schedules s
SET next_fire_at = f.next_fire_at, last_fire_at = f.fire_at, last_job_id = f.job_id
FROM unnest(%(ids)s::bigint[], %(next_fire_ats)s::timestamptz[], %(fire_ats)s::timestamptz[],
            %(job_ids)s::bigint[]) AS f(schedule_id, next_fire_at, fire_at, job_id)
WHERE s.schedule_id = f.schedule_id;
