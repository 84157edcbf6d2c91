-- 0005: workers take only the kinds they can run, a registry of live
-- workers, and an attempt history.

-- Which kinds a queue's runnable jobs may be of, so that a worker is only
-- offered queues it can serve (queues.sql: `candidates`). A hint with the
-- same lock protocol as has_work: every statement that makes a job pending
-- adds its kind, and only a pick that found nothing, under the queue row's
-- lock, narrows it. The invariant: every pending job's kind is in `kinds`,
-- or its run_after is at or after `kinds_due` (jobs not yet due are
-- listed when they become due, at the next failed probe). NULL: any kind
-- (a row from before this migration, or more kinds than the hint holds);
-- the first pick that finds nothing there makes it exact.
ALTER TABLE queues ADD COLUMN kinds text[]
    CONSTRAINT kinds_bounded CHECK (kinds IS NULL OR cardinality(kinds) <= 64);
ALTER TABLE queues ADD COLUMN kinds_due timestamptz NOT NULL DEFAULT 'infinity';

-- The kinds hint after jobs of `added` kinds became pending: the sorted
-- union, or NULL (any kind) past 64 kinds, which keeps every enqueue's
-- update of the row cheap whatever a tenant enqueues.
CREATE FUNCTION queue_kinds(current_kinds text[], added text[]) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN current_kinds IS NULL OR added IS NULL THEN NULL
        WHEN current_kinds @> added THEN current_kinds
        ELSE (SELECT CASE WHEN count(*) > 64 THEN NULL ELSE array_agg(k ORDER BY k) END
              FROM (SELECT DISTINCT unnest(current_kinds || added) AS k) AS u)
    END
$$;

-- How many times the job was sent back from dead (`tenantq dead retry`):
-- attempts start again at 1 after a replay, and the attempt history says
-- which replay each attempt belongs to.
ALTER TABLE jobs ADD COLUMN replays integer NOT NULL DEFAULT 0
    CONSTRAINT replays_nonnegative CHECK (replays >= 0);

-- Live workers: upserted when a worker starts, heartbeated by its
-- maintenance thread, deleted when it stops gracefully. A worker is dead
-- after WORKER_DEAD_AFTER_LEASES lease periods without a heartbeat
-- (workers.sql); dead rows are pruned.
CREATE TABLE workers (
    worker_id      text PRIMARY KEY CONSTRAINT worker_row_id_nonempty CHECK (worker_id <> ''),
    host           text NOT NULL,
    pid            integer NOT NULL,
    -- the kinds it claims; NULL: every kind (an executor that does not say)
    kinds          text[] CONSTRAINT worker_kinds_bounded CHECK (kinds IS NULL OR cardinality(kinds) <= 10000),
    sandbox_driver text NOT NULL,
    lease_seconds  double precision NOT NULL CONSTRAINT lease_seconds_positive CHECK (lease_seconds > 0)
        CONSTRAINT lease_seconds_finite CHECK (lease_seconds > '-Infinity'::float8 AND lease_seconds < 'Infinity'::float8),
    started_at     timestamptz NOT NULL,
    heartbeat_at   timestamptz NOT NULL,
    -- batches in a row whose executor failed before (or while) running
    -- them, and the last such failure (kept after a success, for the record)
    executor_failures      integer NOT NULL DEFAULT 0
        CONSTRAINT executor_failures_nonnegative CHECK (executor_failures >= 0),
    last_executor_error    text,
    last_executor_error_at timestamptz,
    CONSTRAINT executor_error_has_time CHECK ((last_executor_error IS NULL) = (last_executor_error_at IS NULL))
);

-- One row per attempt that ended: done, failed, released before it
-- started (refunded, not counted) or lost with its lease. Written by the
-- statements that settle, release and reap, in their transactions; a
-- running attempt is the job row itself (started_at, batch). No foreign
-- key: jobs are deleted with their attempts by `jobs.prune`, and an FK on
-- job_id would need an index led by job_id for its cascade.
CREATE TABLE attempts (
    tenant_id   text NOT NULL,
    job_id      bigint NOT NULL,
    id          bigint GENERATED ALWAYS AS IDENTITY,
    attempt     integer NOT NULL CONSTRAINT attempt_positive CHECK (attempt >= 1),
    replay      integer NOT NULL DEFAULT 0 CONSTRAINT attempt_replay_nonnegative CHECK (replay >= 0),
    -- when the attempt was counted (its lease), and when it ended
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    worker_id   text NOT NULL,
    driver      text NOT NULL,
    outcome     text NOT NULL CONSTRAINT attempt_outcome_known CHECK (outcome IN ('done', 'failed', 'released', 'lost')),
    error       text,
    CONSTRAINT attempt_failure_has_error CHECK (outcome NOT IN ('failed', 'lost') OR error IS NOT NULL),
    PRIMARY KEY (tenant_id, job_id, id)
);
-- "Recent failures" on the dashboard, newest first, for all tenants or one.
-- Partial: a successful attempt is not in either index.
CREATE INDEX attempts_failures ON attempts (finished_at) WHERE outcome IN ('failed', 'lost');
CREATE INDEX attempts_failures_by_tenant ON attempts (tenant_id, finished_at) WHERE outcome IN ('failed', 'lost');
