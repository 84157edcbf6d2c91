-- Statements about queues: one row per (tenant, priority class), the
-- scheduler's list of queues that may have runnable work.
--
-- The has_work protocol (migration 0014). A statement that makes jobs
-- pending (jobs.sql `insert_one`, `insert`, `settle`, `release_unstarted`,
-- batches.sql `expire`, search.sql `replay_chunk`) inserts `wakes` rows in
-- its own transaction and touches no queue row: an open producer
-- transaction holds nothing anyone else waits for. Workers `fold` the wakes
-- into queue rows before they look for work. The scheduler, before
-- clearing has_work, locks the row (lock_for_clear) and then, in a NEW
-- statement (a new READ COMMITTED snapshot), checks for pending jobs
-- (clear_if_empty). A job the check does not see committed after the check
-- began, together with its wake (one commit), and the fold that takes that
-- wake sets has_work again, after the clear (it waits for the row lock);
-- a fold that took a wake before the check holds the row until it commits,
-- and the check, waiting behind it, sees the job. So no committed job is
-- left in a queue without has_work, and nothing is woken on rollback.
--
-- The kinds hint (`kinds`, `kinds_due`) follows the same protocol, so that
-- a worker is offered only queues with work it can run: a fold adds the
-- kinds of its wakes due now to `kinds` (a wake not yet due moves
-- `kinds_due` to its run_after), and only clear_if_empty narrows it, under
-- the row lock, from what is pending then. Invariant: a pending job's kind
-- is in `kinds`, or its run_after >= `kinds_due`, or its wake is not folded
-- yet. A worker that cannot run any kind in a queue's hint is not offered
-- it (candidates), so it neither charges that tenant's deficit nor spins on
-- it; once `kinds_due` passes, every worker is offered it until one probe
-- finds nothing and makes the hint exact again. NULL kinds: any kind.
-- The fold computes the new kinds with plain aggregates and tests coverage
-- with `@>` first; queue_kinds() (schema.sql) is only called for a kind the
-- hint lacks: a SQL function with a subquery cannot be inlined and is
-- planned again on every call.

-- name: fold_ctes
-- (a fragment: the CTEs of `fold` and `classes_with_work`) The one
-- definition of how queues are woken. Takes up to %(limit)s wakes no
-- other fold holds (SKIP LOCKED: folds never wait for each other's wakes,
-- and a producer's uncommitted wake is not visible), makes the tenants'
-- rows and the queues' rows, in sorted order (the lock order of
-- add_to_deficits), and notifies the workers' channel (Database.
-- notify_channel, spelled from the schema) at commit when it
-- woke something, so a worker that looked while this fold held the wakes
-- looks again ('interactive' when interactive work came: it recalls lent
-- slots).
-- ctid IN (...): a join on the row's address, one lookup per taken row
-- (`= ANY(ARRAY(...))` compared every row with the whole array).
taken AS (
    DELETE FROM wakes w
    WHERE w.ctid IN (SELECT ctid FROM wakes LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
    RETURNING w.tenant_id, w.priority, w.kind, w.run_after
), clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), new_tenants AS (
    INSERT INTO tenants (tenant_id)
    SELECT DISTINCT tenant_id FROM taken ORDER BY tenant_id
    ON CONFLICT (tenant_id) DO NOTHING
), woken AS (
    INSERT INTO queues AS q (tenant_id, priority, has_work, next_run_at, kinds, kinds_due)
    SELECT tenant_id, priority, true, min(run_after),
           CASE WHEN count(DISTINCT kind) FILTER (WHERE run_after <= clock.now) > 64 THEN NULL
                ELSE coalesce(array_agg(DISTINCT kind) FILTER (WHERE run_after <= clock.now), '{}') END,
           coalesce(min(run_after) FILTER (WHERE run_after > clock.now), 'infinity')
    FROM taken, clock
    GROUP BY tenant_id, priority
    ORDER BY tenant_id, priority
    ON CONFLICT (tenant_id, priority) DO UPDATE
        SET has_work = true, next_run_at = least(q.next_run_at, excluded.next_run_at),
            kinds = CASE WHEN NOT q.has_work THEN excluded.kinds WHEN q.kinds @> excluded.kinds THEN q.kinds
                         ELSE queue_kinds(q.kinds, excluded.kinds) END,
            kinds_due = CASE WHEN q.has_work THEN least(q.kinds_due, excluded.kinds_due) ELSE excluded.kinds_due END
        WHERE NOT q.has_work OR q.next_run_at > excluded.next_run_at OR q.kinds_due > excluded.kinds_due
           OR (q.kinds IS NOT NULL AND (excluded.kinds IS NULL OR NOT q.kinds @> excluded.kinds))
), notified AS (
    SELECT pg_notify(left('tenantq_' || current_schema(), 63),
                     CASE WHEN bool_or(priority = 'interactive') THEN 'interactive' ELSE '' END)
    FROM taken HAVING count(*) > 0
)

-- name: fold
-- Wake queues from the wakes alone (`tenantq tenants` before a worker has
-- run, the reaper's backstop): how many wakes it took.
WITH {fold_ctes}
SELECT (SELECT count(*) FROM taken)::integer AS folded, (SELECT count(*) FROM notified)::integer AS notified;

-- name: candidates
-- Queues of one class that may have runnable work, in round-robin order:
-- from the cursor (inclusive: its turn may still be open) to the end, then
-- from the start. It runs right after lock_cursor, as a new statement, so
-- the cursor it reads is the one the previous lock holder committed.
-- Each half joins tenants on its own on purpose: one join over the UNION
-- let the planner hash-join every tenant, which doubled the pick cost at
-- 10,000 active tenants (`./run bench scaling`). The partial index queues_with_work holds only queues with
-- work, so idle tenants cost nothing; LIMIT bounds the rest. `live` is only
-- counted for capped tenants (a hint here; the picker re-counts under the
-- tenant's row lock before it claims). %(kinds)s: the kinds the worker can
-- run (NULL: any); a queue whose kinds hint holds none of them is not a
-- candidate (see "The kinds hint" above). It is a filter on the rows of the
-- same index scan (LIMIT counts the rows that pass), so the index and its
-- order are unchanged. A paused tenant (tenants.paused_at) is no
-- candidate: its queues keep their work and their place, and nothing else
-- waits for it. The `rate_columns` block (filled in below): the tenant's
-- bucket tokens and whether any kind bucket may bound it (rates.py); two
-- primary-key probes of a small table per candidate.
(SELECT q.tenant_id, q.deficit, q.avg_job_seconds, t.weight, t.max_sandboxes, t.egress, t.host_functions,
        q.kinds,
        {rate_columns},
        CASE WHEN t.max_sandboxes IS NULL THEN 0 ELSE
            (SELECT count(*) FROM batches b
             WHERE b.tenant_id = q.tenant_id AND b.ended_at IS NULL
               AND b.lease_expires_at > coalesce(%(now)s::timestamptz, now())) END AS live
 FROM queues q JOIN tenants t USING (tenant_id)
 WHERE q.priority = %(priority)s AND q.has_work AND t.paused_at IS NULL
   AND q.tenant_id >= (SELECT cursor_tenant FROM scheduler WHERE priority = %(priority)s)
   AND q.next_run_at <= coalesce(%(now)s::timestamptz, now())
   AND (%(kinds)s::text[] IS NULL OR q.kinds IS NULL OR q.kinds && %(kinds)s::text[]
        OR q.kinds_due <= coalesce(%(now)s::timestamptz, now()))
 ORDER BY q.tenant_id LIMIT %(limit)s)
UNION ALL
(SELECT q.tenant_id, q.deficit, q.avg_job_seconds, t.weight, t.max_sandboxes, t.egress, t.host_functions,
        q.kinds,
        {rate_columns},
        CASE WHEN t.max_sandboxes IS NULL THEN 0 ELSE
            (SELECT count(*) FROM batches b
             WHERE b.tenant_id = q.tenant_id AND b.ended_at IS NULL
               AND b.lease_expires_at > coalesce(%(now)s::timestamptz, now())) END AS live
 FROM queues q JOIN tenants t USING (tenant_id)
 WHERE q.priority = %(priority)s AND q.has_work AND t.paused_at IS NULL
   AND q.tenant_id < (SELECT cursor_tenant FROM scheduler WHERE priority = %(priority)s)
   AND q.next_run_at <= coalesce(%(now)s::timestamptz, now())
   AND (%(kinds)s::text[] IS NULL OR q.kinds IS NULL OR q.kinds && %(kinds)s::text[]
        OR q.kinds_due <= coalesce(%(now)s::timestamptz, now()))
 ORDER BY q.tenant_id LIMIT %(limit)s);

-- name: add_to_deficits
-- Adds `deltas` to the queues' deficits, never sets them: picks decide
-- under the class's cursor lock but claim, repay and settle outside it
-- (fairness/picker.py), so two writers of one queue's deficit may overlap
-- and an absolute write would lose the other's change. Bounded as `charge`
-- bounds (1e12 = MAX_CREDIT), then at most %(ceiling)s: a claim that got
-- fewer jobs than it was charged for found its queue dry, and a dry queue
-- keeps no credit (ceiling 0); 1e12 otherwise. Returns the queues it wrote.
-- Lock order: the rows are locked in tenant order first (LockRows above
-- the sort), as folds lock them; an UPDATE ... FROM alone locks them in
-- whatever order its join produces, and two writers locking the same rows
-- the other way round deadlocked (found by `./run bench soak`).
-- {locking}: `waiting` outside the cursor lock; `skipping` under it, where
-- a wait would hold every other worker of the class behind this one: a
-- row another transaction holds (a fold, a settle's charge, a probe's
-- clear) is left out, and the picker adds its delta after the decision
-- commits (deltas commute).
WITH ordered AS (
    SELECT q.tenant_id FROM queues q
    WHERE q.priority = %(priority)s AND q.tenant_id = ANY(%(tenant_ids)s::text[])
    ORDER BY q.tenant_id
    {locking}
)
UPDATE queues q
SET deficit = least(%(ceiling)s::float8, greatest(-1e12::float8, least(1e12::float8,
        greatest(-1e12::float8, least(1e12::float8, q.deficit)) + d.delta)))
FROM unnest(%(tenant_ids)s::text[], %(deltas)s::double precision[]) AS d(tenant_id, delta), ordered o
WHERE q.tenant_id = d.tenant_id AND q.priority = %(priority)s AND o.tenant_id = d.tenant_id
RETURNING q.tenant_id;

-- name: waiting
FOR NO KEY UPDATE

-- name: skipping
FOR NO KEY UPDATE SKIP LOCKED

-- name: charge
-- Fairness by run time, when a batch ends (after batches.end in the same
-- transaction): replace the estimate charged at claim time with the
-- measured seconds, and fold the batch's per-job time into the queue's
-- moving average (weight 0.2 for the newest batch).
-- Every operand is bounded first, as fairness/drr.py bounds them (1e12 =
-- MAX_CREDIT, 1e6 = MAX_JOB_SECONDS): the columns are finite (CHECKs), but a
-- finite 1e308 written by hand would still overflow float8 arithmetic, and
-- that error would fail the batch's settle.
UPDATE queues q
SET deficit = greatest(-1e12::float8, least(1e12::float8,
        greatest(-1e12::float8, least(1e12::float8, q.deficit))
        - (least(1e12::float8, b.run_seconds) - least(1e12::float8, coalesce(b.charged_seconds, 0))))),
    avg_job_seconds = CASE
        WHEN %(jobs)s::integer <= 0 THEN q.avg_job_seconds
        WHEN q.avg_job_seconds IS NULL THEN least(1e6::float8, b.run_seconds / %(jobs)s::integer)
        ELSE 0.8 * least(1e6::float8, q.avg_job_seconds)
             + 0.2 * least(1e6::float8, b.run_seconds / %(jobs)s::integer) END
FROM batches b
WHERE b.batch_id = %(batch_id)s AND b.run_seconds IS NOT NULL
  AND q.tenant_id = b.tenant_id AND q.priority = b.priority;

-- name: classes_with_work
-- Which classes have a queue with runnable work this worker can run
-- (%(kinds)s, NULL: any): lets a worker skip the pick transaction of a
-- class with nothing for it (one cheap index read instead). It folds the
-- wakes first ({fold_ctes}); the classes it woke with work due now for
-- these kinds are added, since this statement's read of `queues` cannot
-- see its own writes.
WITH {fold_ctes}
SELECT t.priority
FROM taken t, clock
-- a one-time filter (no column of `taken`): evaluated before any row is
-- read, so the notification goes out whatever the filters below keep
WHERE (SELECT count(*) FROM notified) >= 0
  AND t.run_after <= clock.now AND (%(kinds)s::text[] IS NULL OR t.kind = ANY(%(kinds)s::text[]))
UNION
SELECT priority FROM queues
WHERE has_work AND next_run_at <= coalesce(%(now)s::timestamptz, now())
  AND (%(kinds)s::text[] IS NULL OR kinds IS NULL OR kinds && %(kinds)s::text[]
       OR kinds_due <= coalesce(%(now)s::timestamptz, now()));

-- name: interactive_runnable
-- Interactive work this worker can run (%(kinds)s, NULL: any) is waiting:
-- recalls its lent slots. Work only another app can run recalls nothing.
-- A wake not folded yet counts (the notification may come before the fold).
SELECT EXISTS (
    SELECT 1 FROM queues
    WHERE priority = 'interactive' AND has_work AND next_run_at <= now()
      AND (%(kinds)s::text[] IS NULL OR kinds IS NULL OR kinds && %(kinds)s::text[] OR kinds_due <= now())
) OR EXISTS (
    SELECT 1 FROM wakes
    WHERE priority = 'interactive' AND run_after <= now()
      AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
) AS waiting;

-- name: lock_for_clear
SELECT has_work FROM queues
WHERE tenant_id = %(tenant_id)s AND priority = %(priority)s
FOR UPDATE;

-- name: clear_if_empty
-- Runs in a new statement after lock_for_clear (see the protocol above).
-- With pending jobs left (all in the future), only next_run_at moves, so
-- the queue is skipped until its next job is due. With none, the queue
-- leaves the active list and its DRR credit resets: idle tenants keep none.
-- The kinds hint becomes exact: the kinds of the jobs runnable now, and
-- the first run_after after now (jobs due later are listed then). Three
-- subqueries, each on jobs_runnable: min() alone reads one index entry,
-- while a min() beside array_agg() would read every pending row. The
-- kinds are read from the runnable rows only, which the failed claim just
-- walked anyway. MATERIALIZED: computed once (inlined, each use of
-- p.next_run_at below would run its subquery again).
WITH p AS MATERIALIZED (
    SELECT (SELECT min(run_after) FROM jobs
            WHERE tenant_id = %(tenant_id)s AND priority = %(priority)s AND status = 'pending') AS next_run_at,
           (SELECT CASE WHEN count(DISTINCT kind) > 64 THEN NULL
                        ELSE coalesce(array_agg(DISTINCT kind), '{}') END FROM jobs
            WHERE tenant_id = %(tenant_id)s AND priority = %(priority)s AND status = 'pending'
              AND run_after <= coalesce(%(now)s::timestamptz, now())) AS kinds,
           (SELECT min(run_after) FROM jobs
            WHERE tenant_id = %(tenant_id)s AND priority = %(priority)s AND status = 'pending'
              AND run_after > coalesce(%(now)s::timestamptz, now())) AS kinds_due
)
UPDATE queues q
SET has_work = p.next_run_at IS NOT NULL,
    next_run_at = coalesce(p.next_run_at, q.next_run_at),
    deficit = CASE WHEN p.next_run_at IS NULL THEN 0 ELSE q.deficit END,
    kinds = p.kinds,
    kinds_due = coalesce(p.kinds_due, 'infinity')
FROM p
WHERE q.tenant_id = %(tenant_id)s AND q.priority = %(priority)s
RETURNING q.has_work;

-- name: repair
-- Self-healing backstop run by the reaper now and then: any queue with
-- pending jobs is marked as having work. It only ever sets has_work, so it
-- cannot race the protocol above into losing a queue; its kinds hint
-- becomes "any" (NULL), which the next probe that finds nothing narrows.
UPDATE queues q
SET has_work = true, next_run_at = p.next_run_at, kinds = NULL
FROM (
    SELECT i.tenant_id, i.priority,
           (SELECT min(j.run_after) FROM jobs j
            WHERE j.tenant_id = i.tenant_id AND j.priority = i.priority AND j.status = 'pending')
               AS next_run_at
    FROM queues i
    WHERE NOT i.has_work
) p
WHERE q.tenant_id = p.tenant_id AND q.priority = p.priority
  AND p.next_run_at IS NOT NULL AND NOT q.has_work
RETURNING q.tenant_id, q.priority;

-- name: rate_columns
-- (a fragment of `candidates`) NULL tokens: no tenant limit.
(SELECT least(r.burst, r.tokens + r.per_second * greatest(0, extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - r.refilled_at)))
 FROM rate_limits r WHERE r.tenant_id = q.tenant_id AND r.kind = '') AS rate_tokens,
(SELECT r.per_second FROM rate_limits r WHERE r.tenant_id = q.tenant_id AND r.kind = '') AS rate_per_second,
EXISTS (SELECT 1 FROM rate_limits k WHERE k.tenant_id IN (q.tenant_id, '') AND k.kind <> '') AS kind_limited
