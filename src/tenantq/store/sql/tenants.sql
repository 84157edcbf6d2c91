-- Statements about tenants.

-- name: upsert
-- `tenantq tenant set`: NULL arguments leave the stored value alone; a cap
-- of 0 from the CLI is mapped to NULL (no cap) before it gets here. The
-- retention overrides (seconds) are written when their `*_set` flag is
-- true: a number of seconds, or NULL to go back to the workers' defaults
-- (TENANTQ_RETAIN_DONE / _CANCELLED / _DEAD). The host-function
-- restriction likewise with `host_functions_set` (NULL: no restriction).
INSERT INTO tenants AS t (tenant_id, weight, max_sandboxes, egress, retain_done_seconds,
                          retain_cancelled_seconds, retain_dead_seconds, host_functions)
VALUES (%(tenant_id)s, coalesce(%(weight)s, 1), %(max_sandboxes)s, coalesce(%(egress)s::text[], '{}'),
        %(retain_done)s::float8, %(retain_cancelled)s::float8, %(retain_dead)s::float8,
        %(host_functions)s::text[])
ON CONFLICT (tenant_id) DO UPDATE
SET weight = coalesce(%(weight)s, t.weight),
    max_sandboxes = CASE WHEN %(clear_cap)s THEN NULL
                         ELSE coalesce(%(max_sandboxes)s, t.max_sandboxes) END,
    egress = coalesce(%(egress)s::text[], t.egress),
    retain_done_seconds = CASE WHEN %(retain_done_set)s THEN %(retain_done)s::float8
                               ELSE t.retain_done_seconds END,
    retain_cancelled_seconds = CASE WHEN %(retain_cancelled_set)s THEN %(retain_cancelled)s::float8
                                    ELSE t.retain_cancelled_seconds END,
    retain_dead_seconds = CASE WHEN %(retain_dead_set)s THEN %(retain_dead)s::float8
                               ELSE t.retain_dead_seconds END,
    host_functions = CASE WHEN %(host_functions_set)s THEN %(host_functions)s::text[]
                          ELSE t.host_functions END
RETURNING tenant_id, weight, max_sandboxes, egress, retain_done_seconds, retain_cancelled_seconds,
          retain_dead_seconds, host_functions;

-- name: set_paused
-- `tenantq tenant pause|resume`: the pick skips a paused tenant's queues
-- (queues.sql `candidates`); batches already running finish. Pausing a
-- tenant that has no row yet creates it paused.
INSERT INTO tenants AS t (tenant_id, paused_at)
VALUES (%(tenant_id)s, CASE WHEN %(paused)s THEN now() END)
ON CONFLICT (tenant_id) DO UPDATE
SET paused_at = CASE WHEN %(paused)s THEN coalesce(t.paused_at, now()) END
RETURNING tenant_id, paused_at;

-- name: list
-- The retain_*_seconds columns are the tenant's overrides; NULL: the
-- workers' defaults.
SELECT t.tenant_id, t.weight, t.max_sandboxes, t.egress, t.paused_at,
       t.retain_done_seconds, t.retain_cancelled_seconds, t.retain_dead_seconds, t.host_functions,
       (SELECT count(*) FROM batches b
        WHERE b.tenant_id = t.tenant_id AND b.ended_at IS NULL AND b.lease_expires_at > now()) AS live_batches,
       (SELECT coalesce(sum(q.deficit), 0) FROM queues q WHERE q.tenant_id = t.tenant_id) AS deficit
FROM tenants t
WHERE %(tenant_id)s::text IS NULL OR t.tenant_id = %(tenant_id)s
ORDER BY t.tenant_id;

-- name: lock_for_cap
-- Cap enforcement across dispatchers: picks of different classes run in
-- parallel (one cursor lock per class), so the tenant row is locked before
-- its live leases are counted. FOR NO KEY UPDATE does not conflict with
-- the FOR KEY SHARE locks that enqueues' foreign-key checks take.
-- Lock order everywhere: scheduler row, tenant row, queue row, jobs.
SELECT max_sandboxes FROM tenants WHERE tenant_id = %(tenant_id)s FOR NO KEY UPDATE;

-- name: count_live
-- A separate statement after lock_for_cap on purpose: under READ COMMITTED
-- a subquery in the locking statement would use the snapshot taken before
-- the lock wait and miss the batch the previous lock holder just committed.
SELECT count(*) AS live FROM batches
WHERE tenant_id = %(tenant_id)s AND ended_at IS NULL
  AND lease_expires_at > coalesce(%(now)s::timestamptz, now());
