-- Finding jobs (`tenantq jobs`, the dashboard's search) and the bulk actions
-- on a filtered set. Each statement's `{filters}` is the `filters` block,
-- filled in by store/search.py (statement()), so that listing, counting,
-- cancelling and replaying select exactly the same jobs.
--
-- Indexes: with a tenant, every statement reads an index led by tenant_id
-- (tests/fairness/test_search_plans.py): jobs_by_tenant (tenant_id,
-- created_at, id) walked backwards for newest first; jobs_by_actor (tenant_id,
-- actor, created_at) with an actor; the partial jobs_runnable (pending) and
-- jobs_dead (dead) for a status. Kind and meta are filters on the rows of that
-- scan: no index serves them alone, and a tenant's rows are what is read.
--
-- The parameters are bound as values when the statement is planned (psycopg
-- sends them with the query), so `%(x)s IS NULL OR ...` of an unset filter
-- folds away and the planner sees only the filters that were given.

-- name: filters
-- Every filter; NULL = any. (jobs_runnable leads with (tenant_id, priority):
-- a tenant's pending jobs of one class are read off it.) `since` counts back from %(now)s (NULL: the
-- database clock); the bulk actions pass the clock they started at.
    (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s::text)
    AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
    AND (%(status)s::text IS NULL OR status = %(status)s::text)
    AND (%(actor)s::text IS NULL OR actor = %(actor)s::text)
    AND (%(meta)s::jsonb IS NULL OR meta @> %(meta)s::jsonb)
    AND (%(priority)s::text IS NULL OR priority = %(priority)s::text)
    AND (%(since_seconds)s::float8 IS NULL
         OR created_at >= coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(since_seconds)s::float8))

-- name: find_in_tenant
-- One tenant's jobs, newest first, one page (%(limit)s is the page size + 1,
-- to know whether an older page exists). Keyset: the page after the one that
-- ended at (before_at, before_id) starts strictly below it in the index order
-- (created_at DESC, id DESC): an Index Scan Backward on jobs_by_tenant whose
-- row comparison is an index condition, so a deep page costs what the first
-- does. With an actor or a status the planner may read jobs_by_actor,
-- jobs_runnable or jobs_dead instead (and sort that tenant's matching rows).
SELECT id, tenant_id, kind, priority, status, attempts, max_attempts, actor, meta, created_at,
       split_part(last_error, E'\n', 1) AS error_line
FROM jobs
WHERE {filters}
  AND (%(before_at)s::timestamptz IS NULL
       OR (created_at, id) < (%(before_at)s::timestamptz, %(before_id)s::bigint))
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s;

-- name: find_all
-- Every tenant's jobs (no tenant filter), newest first by id: the identity is
-- assigned as jobs are inserted, so id order is creation order (up to
-- transactions that commit out of order), and a backward scan of the primary
-- key (jobs_pkey) reads the newest first and stops after one page. No index
-- leads with created_at alone; ordering by it here would read and sort the
-- whole table. Keyset on id (the cursor's id).
SELECT id, tenant_id, kind, priority, status, attempts, max_attempts, actor, meta, created_at,
       split_part(last_error, E'\n', 1) AS error_line
FROM jobs
WHERE {filters}
  AND (%(before_id)s::bigint IS NULL OR id < %(before_id)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: actionable_counts
-- How many jobs of the filtered set the bulk actions would touch: pending
-- (cancel) and dead (retry). One count per status, so that each can read
-- its partial index (jobs_runnable, jobs_dead), led by tenant_id, which
-- holds only that status's rows: without a tenant too, the done jobs (most
-- of the table) are never read.
SELECT (SELECT count(*) FROM jobs WHERE {filters} AND status = 'pending')::integer AS pending,
       (SELECT count(*) FROM jobs WHERE {filters} AND status = 'dead')::integer AS dead;

-- name: bounds
-- Where a bulk action starts: its clock and the newest job then. It acts on
-- jobs that existed then (id <= max_id), so that jobs enqueued while it runs
-- are not chased, and it ends.
SELECT coalesce(%(now)s::timestamptz, now()) AS as_of,
       coalesce((SELECT max(id) FROM jobs), 0)::bigint AS max_id;

-- name: cancel_chunk
-- Cancel up to %(chunk)s pending jobs of the filtered set: one statement
-- (one transaction) per chunk, so no statement holds many row locks for long;
-- the caller repeats while a chunk comes back full. SKIP LOCKED: a job a
-- worker is claiming right now is passed over (it is about to run), never
-- waited on. Cancelled jobs have ended: their waiters are woken at commit as
-- jobs.sql `cancel` and `settle` wake them (the ids, or '*' past NOTIFY's
-- payload limit: every waiter re-checks). `ended` is referenced in the final
-- SELECT: a CTE that only SELECTs runs only when something reads it.
WITH target AS (
    SELECT id FROM jobs
    WHERE {filters}
      AND status = 'pending' AND id <= %(max_id)s::bigint
    LIMIT %(chunk)s
    FOR UPDATE SKIP LOCKED
), cancelled AS (
    UPDATE jobs j
    SET status = 'cancelled', finished_at = coalesce(%(at)s::timestamptz, now())
    FROM target t
    WHERE j.id = t.id AND j.status = 'pending'
    RETURNING j.id
), ended AS (
    SELECT pg_notify(left('tenantq_done_' || current_schema(), 63),
                     CASE WHEN length(ids) <= 7900 THEN ids ELSE '*' END)
    FROM (SELECT string_agg(id::text, ',') AS ids FROM cancelled) AS d
    WHERE ids IS NOT NULL
)
SELECT (SELECT count(*) FROM target)::integer AS picked,
       (SELECT count(*) FROM cancelled)::integer AS changed,
       (SELECT count(*) FROM ended)::integer AS notified;

-- name: cancel_running_chunk
-- Ask up to %(chunk)s running jobs of the filtered set to stop (`tenantq
-- cancel --tenant T --running`), with jobs.sql `cancel`'s protocol for a
-- running job: cancel_requested_at and cancelled_by are set, and the worker
-- holding its batch is notified on the workers' channel with
-- 'cancel:<batch_id>:<job_id>' (one notification per job, sent at commit);
-- it stops the job and settles it `cancelled` (dispatch/cancels.py). A job
-- already asked is not asked again (its worker's maintenance tick re-reads
-- the requests: jobs.sql `cancel_requests`), so chunks move on and the
-- action ends. Running jobs are found through the live batches
-- (batches_live, then jobs_by_batch): a tenant's running jobs are few, its
-- finished ones many. SKIP LOCKED: a job being settled right now is passed
-- over (it is ending anyway).
WITH target AS (
    SELECT id, batch_id FROM jobs
    WHERE {filters}
      AND status = 'running' AND cancel_requested_at IS NULL AND id <= %(max_id)s::bigint
      AND batch_id IN (SELECT b.batch_id FROM batches b
                       WHERE b.ended_at IS NULL
                         AND (%(tenant_id)s::text IS NULL OR b.tenant_id = %(tenant_id)s::text))
    LIMIT %(chunk)s
    FOR UPDATE SKIP LOCKED
), requested AS (
    UPDATE jobs j
    SET cancel_requested_at = coalesce(%(at)s::timestamptz, now()),
        cancelled_by = coalesce(j.cancelled_by, %(by)s::text)
    FROM target t
    WHERE j.id = t.id AND j.status = 'running' AND j.cancel_requested_at IS NULL
    RETURNING j.id, j.batch_id
), asked AS (
    SELECT pg_notify(%(channel)s, 'cancel:' || batch_id || ':' || id) FROM requested
)
SELECT (SELECT count(*) FROM target)::integer AS picked,
       (SELECT count(*) FROM requested)::integer AS changed,
       (SELECT count(*) FROM asked)::integer AS notified;

-- name: retry_dead_chunk
-- Replay up to %(chunk)s dead jobs of the filtered set, with jobs.sql
-- `retry_dead`'s semantics: back to pending with a fresh set of attempts
-- (numbered from 1 again), `replays` + 1, the last error kept; their queues
-- are woken (their wakes: queues.sql, the has_work protocol) and
-- the workers notified (as jobs.sql `insert` does: 'interactive' when
-- interactive work came back, which recalls lent slots) in the same
-- statement, so each chunk commits whole. Only jobs dead before the action
-- started (finished_at <= %(now)s): a replayed job that dies again meanwhile is
-- not replayed twice by the same action.
WITH clock AS (
    SELECT coalesce(%(at)s::timestamptz, now()) AS now
), target AS (
    SELECT id FROM jobs
    WHERE {filters}
      AND status = 'dead' AND id <= %(max_id)s::bigint
      AND finished_at <= coalesce(%(now)s::timestamptz, now())
    LIMIT %(chunk)s
    FOR UPDATE SKIP LOCKED
), replayed AS (
    UPDATE jobs j
    SET status = 'pending', attempts = 0, finished_at = NULL, started_at = NULL, replays = j.replays + 1,
        run_after = clock.now
    FROM target t, clock
    WHERE j.id = t.id AND j.status = 'dead'
    RETURNING j.id, j.tenant_id, j.priority, j.run_after, j.kind
), woken AS (
    -- wakes, not the queue row (queues.sql, "The has_work protocol")
    INSERT INTO wakes (tenant_id, priority, kind, run_after)
    SELECT tenant_id, priority, kind, min(run_after) FROM replayed
    GROUP BY tenant_id, priority, kind
), wake_listeners AS (
    SELECT pg_notify(%(channel)s,
                     CASE WHEN EXISTS (SELECT 1 FROM replayed WHERE priority = 'interactive')
                          THEN 'interactive' ELSE '' END)
    FROM (SELECT 1 FROM replayed LIMIT 1) AS any_replayed
)
SELECT (SELECT count(*) FROM target)::integer AS picked,
       (SELECT count(*) FROM replayed)::integer AS changed,
       (SELECT count(*) FROM wake_listeners)::integer AS notified;
