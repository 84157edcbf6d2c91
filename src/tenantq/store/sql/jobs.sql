-- Statements about jobs. `%(now)s` is NULL in production (the database
-- clock, shared by every dispatcher) and a fixed time in tests.

-- name: insert_one
-- One job (`Queue.enqueue`): scalar parameters, one round trip. It writes
-- only rows of its own, the job and its wake, and touches no shared row
-- (no tenant or queue row, no foreign key to check): in the caller's
-- transaction (`conn=`) it holds nothing another producer or a worker
-- waits for (queues.sql, "The has_work protocol"). A key already used
-- inserts nothing and returns no row (the id is then looked up by key);
-- only another producer's uncommitted job with the same key is waited for
-- (a unique index must know whether it commits). The notification is
-- delivered at commit, when the job is visible; none on rollback.
-- Names are qualified ({schema}, filled in by queries.qualified()): this
-- statement also runs on the caller's own connection, whatever its
-- search_path is.
WITH inserted AS (
    INSERT INTO {schema}.jobs (tenant_id, kind, payload, priority, max_attempts, run_after, idempotency_key,
                               created_at, actor, meta)
    SELECT %(tenant_id)s, %(kind)s, %(payload)s, %(priority)s, %(max_attempts)s,
           c.now + make_interval(secs => %(delay)s), %(key)s, c.now, %(actor)s, %(meta)s
    FROM (SELECT coalesce(%(now)s::timestamptz, now()) AS now) AS c
    ON CONFLICT (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, run_after
), woken AS (
    INSERT INTO {schema}.wakes (tenant_id, priority, kind, run_after)
    SELECT %(tenant_id)s, %(priority)s, %(kind)s, run_after FROM inserted
)
SELECT id, pg_notify(%(channel)s, %(note)s) AS notified FROM inserted;

-- name: insert
-- Many jobs in one round trip: every column arrives as an array and
-- unnest() turns them into rows. The CTEs run as one statement, so the
-- jobs and their wakes commit together. Like `insert_one`, it writes only
-- rows of its own (jobs, and one wake per tenant, class and kind with the
-- least run_after). Qualified names: see `insert_one`.
--
-- Rows are inserted in input order (ORDER BY ord), so identity values come
-- back ascending in input order; rows skipped by an idempotency-key conflict
-- are looked up afterwards by key, and wake nothing.
--
-- With %(digest)s the input is not jobs but a digest of the jobs that
-- `copy_in` writes next in the same transaction (store/enqueue.py): one row
-- per tenant, class and kind, with its least delay. Its wakes are written
-- and the workers notified as for those jobs, and no job is inserted.
WITH input AS (
    SELECT *
    FROM unnest(
        %(tenant_ids)s::text[], %(kinds)s::text[], %(payloads)s::jsonb[], %(priorities)s::text[],
        %(max_attempts)s::integer[], %(delays)s::double precision[], %(keys)s::text[],
        %(actors)s::text[], %(metas)s::jsonb[]
    ) WITH ORDINALITY AS i(tenant_id, kind, payload, priority, max_attempts, delay, idempotency_key,
                           actor, meta, ord)
), clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), inserted AS (
    INSERT INTO {schema}.jobs (tenant_id, kind, payload, priority, max_attempts, run_after, idempotency_key,
                               created_at, actor, meta)
    SELECT i.tenant_id, i.kind, i.payload, i.priority, i.max_attempts,
           clock.now + make_interval(secs => i.delay), i.idempotency_key, clock.now, i.actor, i.meta
    FROM input i, clock
    WHERE NOT %(digest)s::boolean
    ORDER BY i.ord
    ON CONFLICT (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, tenant_id, idempotency_key, priority, kind, run_after
), woken AS (
    INSERT INTO {schema}.wakes (tenant_id, priority, kind, run_after)
    SELECT tenant_id, priority, kind, min(run_after)
    FROM (SELECT tenant_id, priority, kind, run_after FROM inserted
          UNION ALL
          SELECT i.tenant_id, i.priority, i.kind, clock.now + make_interval(secs => i.delay)
          FROM input i, clock WHERE %(digest)s::boolean) AS w
    GROUP BY tenant_id, priority, kind
), wake_listeners AS (
    -- delivered at commit (nothing on rollback), so a woken worker already
    -- sees the jobs; one notification per statement
    -- the payload tells workers whether interactive work arrived, which
    -- recalls slots lent out of the interactive reservation
    SELECT pg_notify(%(channel)s,
                     CASE WHEN EXISTS (SELECT 1 FROM input WHERE priority = 'interactive')
                          THEN 'interactive' ELSE '' END)
    FROM (SELECT 1 FROM inserted UNION ALL SELECT 1 WHERE %(digest)s::boolean LIMIT 1) AS any_inserted
)
SELECT id, tenant_id, idempotency_key
FROM inserted
-- A one-time filter (it names no column of `inserted`): Postgres evaluates
-- it before reading any row, so the notification is sent with a digest too,
-- where `inserted` is empty (a join with it would never run wake_listeners).
WHERE (SELECT count(*) FROM wake_listeners) >= 0
ORDER BY id;

-- name: reserve_ids
-- The ids of %(n)s jobs that `copy_in` writes, ascending, and the clock of
-- their transaction. The sequence is looked up once (a scalar subquery, an
-- InitPlan), not once per row; %(jobs_table)s is the quoted, qualified name.
SELECT coalesce(%(now)s::timestamptz, now()) AS now,
       array(SELECT nextval((SELECT pg_get_serial_sequence(%(jobs_table)s, 'id'))::regclass)
             FROM generate_series(1, %(n)s)) AS ids;

-- name: copy_in
-- Jobs without idempotency keys from a bulk enqueue, after `insert` ran
-- with their digest in the same transaction (their wakes). COPY writes the
-- reserved identity values as given.
COPY {schema}.jobs (id, tenant_id, kind, payload, priority, max_attempts, run_after, created_at, actor, meta)
FROM STDIN (FORMAT binary);

-- name: ids_by_key
-- Qualified like `insert`, which it follows on the same connection.
SELECT id, tenant_id, idempotency_key
FROM {schema}.jobs
WHERE (tenant_id, idempotency_key) IN (
    SELECT * FROM unnest(%(tenant_ids)s::text[], %(keys)s::text[])
);

-- name: notify
SELECT pg_notify(%(channel)s, '');

-- name: wake
-- Jobs another statement made pending (the reaper's expired leases, a
-- replay): their wakes, one per tenant, class and kind with the least
-- run_after (queues.sql, "The has_work protocol").
INSERT INTO wakes (tenant_id, priority, kind, run_after)
SELECT tenant_id, priority, kind, min(run_after)
FROM unnest(%(tenant_ids)s::text[], %(priorities)s::text[], %(kinds)s::text[], %(run_afters)s::timestamptz[])
    AS w(tenant_id, priority, kind, run_after)
GROUP BY tenant_id, priority, kind;

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
-- %(kinds)s: the kinds the worker's app registers (NULL: any). It filters
-- rows read from jobs_runnable, so the scan stays on that index and in its
-- order; the pick only offers queues whose kinds hint matches, so the rows
-- it walks past are the tenant's older runnable jobs of other kinds.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), picked AS MATERIALIZED (
    SELECT j.id
    FROM jobs j, clock
    WHERE j.tenant_id = %(tenant_id)s
      AND j.priority = %(priority)s
      AND j.status = 'pending'
      AND j.run_after <= clock.now
      AND (%(kinds)s::text[] IS NULL OR j.kind = ANY(%(kinds)s::text[]))
    ORDER BY j.run_after, j.id
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
), {lease};

-- name: claim_within_quotas
-- `claim` for a tenant some of whose kinds are rate limited (rates.py):
-- kinds whose buckets are empty (%(exhausted)s) are not read at all, and
-- at most %(quotas)s jobs of each limited kind are taken (oldest first per
-- kind, row_number() over the locked rows). FOR UPDATE cannot go with a
-- window function, so the rows are locked in `scanned` (at most
-- %(scan)s); those left out stay locked only until the pick commits.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), scanned AS MATERIALIZED (
    SELECT j.id, j.kind, j.run_after
    FROM jobs j, clock
    WHERE j.tenant_id = %(tenant_id)s
      AND j.priority = %(priority)s
      AND j.status = 'pending'
      AND j.run_after <= clock.now
      AND (%(kinds)s::text[] IS NULL OR j.kind = ANY(%(kinds)s::text[]))
      AND NOT (j.kind = ANY(%(exhausted)s::text[]))
    ORDER BY j.run_after, j.id
    LIMIT %(scan)s
    FOR UPDATE OF j SKIP LOCKED
), picked AS MATERIALIZED (
    SELECT r.id FROM (
        SELECT s.id, s.run_after, q.quota,
               row_number() OVER (PARTITION BY s.kind ORDER BY s.run_after, s.id) AS nth
        FROM scanned s
        LEFT JOIN unnest(%(quota_kinds)s::text[], %(quotas)s::integer[]) AS q(kind, quota) ON q.kind = s.kind
    ) AS r
    WHERE r.quota IS NULL OR r.nth <= r.quota
    ORDER BY r.run_after, r.id
    LIMIT %(limit)s
), {lease};

-- name: lease
-- (a fragment: the end of `claim` and `claim_within_quotas`, after `picked`)
batch AS (
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
          j.max_attempts, b.batch_id, b.lease_expires_at, j.actor, j.meta::text AS meta_text,
          -- isfinite: a run_after of '-infinity' (written by hand) cannot be subtracted
          CASE WHEN isfinite(j.run_after)
               THEN greatest(extract(epoch FROM clock.now - j.run_after), 0)::double precision
               ELSE 0::double precision END AS waited;

-- name: settle
-- Apply each job's outcome, but only while the job still runs under the
-- presenting lease (batch_id = fencing token AND status = 'running'): a
-- zombie whose lease was reaped and re-leased matches no row. Jobs that go
-- back to pending (retries) write their wakes in the same statement (see
-- the has_work protocol in queues.sql). Each settled job's attempt is recorded
-- in `attempts` by the same statement (no extra round trip); a job that
-- succeeds loses its last_error, which the history keeps.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), lease AS (
    SELECT worker_id, sandbox_driver FROM batches WHERE batch_id = %(batch_id)s
), outcome AS (
    SELECT *
    -- results come as JSON text (a text[] is dumped by psycopg's C code, a
    -- jsonb[] element by element in Python) and are parsed once, here
    FROM unnest(%(ids)s::bigint[], %(statuses)s::text[], %(results)s::text[], %(errors)s::text[],
                %(delays)s::double precision[], %(host_calls)s::jsonb[])
         AS o(id, status, result, error, delay, host_calls)
), settled AS (
    UPDATE jobs j
    -- A job asked to stop while it ran (cancel_requested_at: `tenantq
    -- cancel`, read here from the row's latest version, under its lock)
    -- ends cancelled whatever its run reported, whether or not its worker
    -- had heard of the request: no retry, no result.
    SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE o.status END,
        result = CASE WHEN o.status = 'done' AND j.cancel_requested_at IS NULL
                      THEN coalesce(o.result::jsonb, 'null'::jsonb) ELSE j.result END,
        last_error = CASE WHEN j.cancel_requested_at IS NOT NULL AND o.status <> 'cancelled'
                          THEN 'cancelled while running: ' || coalesce(o.error, 'it had finished (its result is dropped)')
                          WHEN o.status = 'done' THEN NULL ELSE coalesce(o.error, j.last_error) END,
        batch_id = NULL,
        run_after = CASE WHEN o.status = 'pending' AND j.cancel_requested_at IS NULL
                         THEN clock.now + make_interval(secs => o.delay) ELSE j.run_after END,
        finished_at = CASE WHEN o.status IN ('done', 'dead', 'cancelled') OR j.cancel_requested_at IS NOT NULL
                           THEN clock.now END
    FROM outcome o, clock
    WHERE j.id = o.id AND j.batch_id = %(batch_id)s AND j.status = 'running'
    RETURNING j.id, j.tenant_id, j.priority, j.status, j.run_after, j.kind, j.attempts, j.replays,
              j.started_at, o.error, o.host_calls
), recorded AS (
    INSERT INTO attempts (tenant_id, job_id, attempt, replay, started_at, finished_at, worker_id, driver,
                          outcome, error, host_calls)
    SELECT s.tenant_id, s.id, s.attempts, s.replays, coalesce(s.started_at, clock.now), clock.now,
           l.worker_id, l.sandbox_driver,
           CASE WHEN s.status IN ('done', 'cancelled') THEN s.status ELSE 'failed' END,
           CASE WHEN s.status IN ('done', 'cancelled') THEN s.error ELSE coalesce(s.error, 'failed') END,
           s.host_calls
    FROM settled s, lease l, clock
), woken AS (
    -- wakes, not the queue row (queues.sql, "The has_work protocol")
    INSERT INTO wakes (tenant_id, priority, kind, run_after)
    SELECT tenant_id, priority, kind, min(run_after) FROM settled
    WHERE status = 'pending'
    GROUP BY tenant_id, priority, kind
), ended AS (
    -- wakes `Queue.wait()` callers at commit: the ids of the jobs that ended
    -- (client/listener.py; the channel is the schema's: Database.done_channel).
    -- Past NOTIFY's 8000-byte payload limit, '*': every waiter re-checks.
    SELECT pg_notify(left('tenantq_done_' || current_schema(), 63),
                     CASE WHEN length(ids) <= 7900 THEN ids ELSE '*' END)
    FROM (SELECT string_agg(id::text, ',') AS ids FROM settled WHERE status IN ('done', 'dead', 'cancelled')) AS d
    WHERE ids IS NOT NULL
)
SELECT id, status FROM settled, (SELECT count(*) FROM ended) AS notified;

-- name: release_unstarted
-- Jobs of a batch that never started go back without losing the attempt
-- that the claim counted, and wake their queue. The history records the
-- release (outcome `released`, the attempt number it would have been).
-- One asked to stop meanwhile (its worker had not heard yet) ends
-- cancelled instead, and its waiters are woken.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), lease AS (
    SELECT worker_id, sandbox_driver, created_at FROM batches WHERE batch_id = %(batch_id)s
), released AS (
    UPDATE jobs
    SET status = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'pending' END,
        finished_at = CASE WHEN cancel_requested_at IS NOT NULL THEN coalesce(%(now)s::timestamptz, now()) END,
        batch_id = NULL, attempts = attempts - 1, started_at = NULL
    WHERE batch_id = %(batch_id)s AND status = 'running' AND id = ANY(%(ids)s::bigint[])
    RETURNING id, tenant_id, priority, run_after, kind, attempts, replays, status
), ended AS (
    SELECT pg_notify(left('tenantq_done_' || current_schema(), 63),
                     CASE WHEN length(string_agg(id::text, ',')) <= 7900 THEN string_agg(id::text, ',') ELSE '*' END)
    FROM released WHERE status = 'cancelled' HAVING count(*) > 0
), recorded AS (
    INSERT INTO attempts (tenant_id, job_id, attempt, replay, started_at, finished_at, worker_id, driver,
                          outcome)
    SELECT r.tenant_id, r.id, r.attempts + 1, r.replays, least(l.created_at, clock.now), clock.now,
           l.worker_id, l.sandbox_driver, 'released'
    FROM released r, lease l, clock
), woken AS (
    -- wakes, not the queue row (queues.sql, "The has_work protocol")
    INSERT INTO wakes (tenant_id, priority, kind, run_after)
    SELECT tenant_id, priority, kind, min(run_after) FROM released
    WHERE status = 'pending'
    GROUP BY tenant_id, priority, kind
)
SELECT id FROM released, (SELECT count(*) FROM ended) AS notified;

-- name: get
SELECT j.*, b.worker_id AS lease_owner, b.lease_expires_at
FROM jobs j
LEFT JOIN batches b ON b.batch_id = j.batch_id
WHERE j.id = %(id)s;

-- name: status_of
SELECT status FROM jobs WHERE id = %(id)s;

-- name: cancel
-- `tenantq cancel ID`: a pending job ends `cancelled` at once (its waiters
-- are woken at commit, see `settle`); a running one is asked to stop:
-- cancel_requested_at is set and its worker is notified on the workers'
-- channel ('cancel:<batch>:<job>'), stops it and settles it `cancelled`
-- (dispatch/cancels.py). The row lock orders a cancel against a settle.
WITH target AS (
    SELECT id, status, batch_id FROM jobs WHERE id = %(id)s FOR UPDATE
), cancelled AS (
    UPDATE jobs j
    SET status = 'cancelled', finished_at = coalesce(%(now)s::timestamptz, now()), cancelled_by = %(by)s
    FROM target t
    WHERE j.id = t.id AND t.status = 'pending'
    RETURNING j.id
), requested AS (
    UPDATE jobs j
    SET cancel_requested_at = coalesce(j.cancel_requested_at, coalesce(%(now)s::timestamptz, now())),
        cancelled_by = coalesce(j.cancelled_by, %(by)s)
    FROM target t
    WHERE j.id = t.id AND t.status = 'running'
    RETURNING j.id, t.batch_id
), ended AS (
    SELECT pg_notify(left('tenantq_done_' || current_schema(), 63), id::text) FROM cancelled
), asked AS (
    SELECT pg_notify(%(channel)s, 'cancel:' || batch_id || ':' || id) FROM requested
)
SELECT t.status AS was, (SELECT count(*) FROM ended) + (SELECT count(*) FROM asked) AS notified
FROM target t;

-- name: cancel_requests
-- The cancel requests for jobs of these (live) batches: a worker's
-- maintenance tick reads them, in case it missed the notification.
SELECT id, batch_id FROM jobs
WHERE batch_id = ANY(%(batch_ids)s::bigint[]) AND status = 'running' AND cancel_requested_at IS NOT NULL;

-- name: dead_list
SELECT id, tenant_id, kind, priority, attempts, max_attempts, last_error, finished_at
FROM jobs
WHERE status = 'dead' AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s)
ORDER BY finished_at DESC, id DESC
LIMIT %(limit)s;

-- name: retry_dead
-- Replay dead jobs: back to pending with a fresh set of attempts (numbered
-- from 1 again) and `replays` + 1, which the attempt history records with
-- every later attempt, so the attempts before the replay stay readable.
-- The last error is kept until the job succeeds or fails again.
-- SKIP LOCKED so a replay never waits on a row some other statement holds.
WITH target AS (
    SELECT id FROM jobs
    WHERE status = 'dead'
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
      AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s)
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs j
SET status = 'pending', attempts = 0, finished_at = NULL, started_at = NULL, replays = j.replays + 1,
    run_after = coalesce(%(now)s::timestamptz, now())
FROM target t
WHERE j.id = t.id
RETURNING j.id, j.tenant_id, j.priority, j.status, j.run_after, j.kind;

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

-- name: attempts_of
-- A job's attempt history, newest first (the job page shows the newest
-- %(limit)s); the primary key (tenant_id, job_id, id) serves it.
SELECT attempt, replay, started_at, finished_at, worker_id, driver, outcome, error, host_calls,
       extract(epoch FROM finished_at - started_at)::double precision AS seconds
FROM attempts
WHERE tenant_id = %(tenant_id)s AND job_id = %(id)s
ORDER BY id DESC
LIMIT %(limit)s;

-- name: prune
-- Retention: finished jobs whose window has passed go, with their attempt
-- history and refused-egress rows, at most %(limit)s per statement, so a
-- large backlog goes in small steps that hold few locks for a short time
-- and never block claims (which touch only pending rows).
-- Each tenant has its own windows (tenants.retain_*_seconds, else the
-- defaults passed in; %(older_than)s, when given, overrides them all), so
-- the scan walks tenants and, per tenant and final status, the partial
-- index on (tenant_id, finished_at) of that status, oldest first: a
-- tenant whose window is long costs its probes, never a walk over its rows.
-- FOR UPDATE cannot go with UNION: the rows are locked in `doomed`, SKIP
-- LOCKED so a row someone else holds (a replay) waits for the next round.
-- With %(dry_run)s nothing is deleted; the count of what would go comes back.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), expired AS (
    SELECT e.id, t.tenant_id, t.turn
    -- tenants in turn from just after %(after)s (the last tenant the
    -- previous chunk reached), round to it: a chunk filled by one tenant's
    -- backlog (a whale's) is followed by the next tenants', not by that
    -- one's again, so every tenant keeps its window; one statement still
    -- covers every tenant, so a chunk short of the limit means none is left
    FROM (SELECT tt.*, row_number() OVER (ORDER BY tt.tenant_id <= %(after)s, tt.tenant_id) AS turn
          FROM tenants tt ORDER BY turn) AS t, clock,
    LATERAL (
        (SELECT id FROM jobs
         WHERE tenant_id = t.tenant_id AND status = 'done'
           AND finished_at < clock.now - make_interval(secs => coalesce(%(older_than)s, t.retain_done_seconds, %(done)s))
         ORDER BY finished_at LIMIT %(limit)s)
        UNION ALL
        (SELECT id FROM jobs
         WHERE tenant_id = t.tenant_id AND status = 'cancelled'
           AND finished_at < clock.now - make_interval(secs => coalesce(%(older_than)s, t.retain_cancelled_seconds, %(cancelled)s))
         ORDER BY finished_at LIMIT %(limit)s)
        UNION ALL
        (SELECT id FROM jobs
         WHERE tenant_id = t.tenant_id AND status = 'dead'
           AND finished_at < clock.now - make_interval(secs => coalesce(%(older_than)s, t.retain_dead_seconds, %(dead)s))
         ORDER BY finished_at LIMIT %(limit)s)
    ) AS e
    LIMIT %(limit)s
), doomed AS (
    SELECT j.id, j.tenant_id, j.status FROM jobs j
    WHERE j.id IN (SELECT id FROM expired) AND j.status IN ('done', 'dead', 'cancelled')
    FOR UPDATE SKIP LOCKED
), history AS (
    DELETE FROM attempts a USING doomed d
    WHERE NOT %(dry_run)s AND a.tenant_id = d.tenant_id AND a.job_id = d.id
), blocks AS (
    DELETE FROM egress_blocks b USING doomed d
    WHERE NOT %(dry_run)s AND b.tenant_id = d.tenant_id AND b.job_id = d.id
), deleted AS (
    DELETE FROM jobs j USING doomed d
    WHERE NOT %(dry_run)s AND j.id = d.id
    RETURNING j.status
)
SELECT d.status, count(*) AS n,
       (SELECT x.tenant_id FROM expired x ORDER BY x.turn DESC LIMIT 1) AS last_tenant
FROM doomed d GROUP BY d.status;
