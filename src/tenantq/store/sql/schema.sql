-- tenantq schema: the single source of truth for a fresh install.
--
-- `tenantq migrate` applies this file to an empty schema and records every
-- migration in migrations/ as applied; an existing schema gets only the
-- migrations it lacks. tests/integration/test_schema.py proves that applying
-- all migrations in order yields exactly this schema.
--
-- Every object lives in the schema named by TENANTQ_SCHEMA (the connection's
-- search_path), so names here are unqualified.
--
-- Finite numbers: a double precision column accepts NaN and ±Infinity, and
-- NaN passes a `>= 0` CHECK (Postgres sorts NaN above every number). Every
-- float column therefore also has a `<column>_finite` CHECK,
-- `x > '-Infinity' AND x < 'Infinity'`, which is false for NaN and for both
-- infinities (migration 0004).

CREATE TABLE tenants (
    tenant_id     text PRIMARY KEY
        CONSTRAINT tenant_id_format CHECK (tenant_id ~ '^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$'),
    -- plan tier: the tenant's DRR quantum is proportional to it
    weight        integer NOT NULL DEFAULT 1 CONSTRAINT weight_range CHECK (weight BETWEEN 1 AND 10000),
    -- cap on concurrently live batches (sandboxes); NULL = no cap
    max_sandboxes integer CONSTRAINT max_sandboxes_positive CHECK (max_sandboxes IS NULL OR max_sandboxes >= 1),
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- hosts its sandboxed jobs may reach through the egress proxy; empty = none
    egress        text[] NOT NULL DEFAULT '{}' CONSTRAINT egress_rule_count CHECK (cardinality(egress) <= 64),
    -- paused: the pick skips its queues; running batches finish (NULL: not paused)
    paused_at     timestamptz,
    -- retention overrides in seconds (NULL: the worker's defaults)
    retain_done_seconds double precision
        CONSTRAINT retain_done_seconds_finite CHECK (retain_done_seconds IS NULL OR (retain_done_seconds >= 0 AND retain_done_seconds < 'Infinity'::float8)),
    retain_cancelled_seconds double precision
        CONSTRAINT retain_cancelled_seconds_finite CHECK (retain_cancelled_seconds IS NULL OR (retain_cancelled_seconds >= 0 AND retain_cancelled_seconds < 'Infinity'::float8)),
    retain_dead_seconds double precision
        CONSTRAINT retain_dead_seconds_finite CHECK (retain_dead_seconds IS NULL OR (retain_dead_seconds >= 0 AND retain_dead_seconds < 'Infinity'::float8)),
    -- the host functions its handlers may call: NULL every one they
    -- declare, else only these (empty: none)
    host_functions text[]
        CONSTRAINT host_function_count CHECK (host_functions IS NULL OR cardinality(host_functions) <= 256)
);

-- One row per (tenant, priority class) that ever had a job: the scheduler's
-- active list. `has_work` is a hint kept true while the queue has pending jobs
-- so that a pick scans only queues with work (cost independent of idle
-- tenants); see queues.sql for the lock protocol that keeps it from going
-- false under a concurrent enqueue.
CREATE TABLE queues (
    tenant_id  text NOT NULL REFERENCES tenants (tenant_id) ON DELETE CASCADE,
    priority   text NOT NULL CONSTRAINT queue_priority_known CHECK (priority IN ('interactive', 'default', 'bulk')),
    has_work   boolean NOT NULL DEFAULT true,
    -- earliest run_after among its pending jobs, as far as the scheduler knows
    next_run_at timestamptz NOT NULL DEFAULT '-infinity',
    -- deficit round robin credit, in cost units (jobs or seconds); may be
    -- negative (runtime debt), never NaN or infinite (see "Finite numbers")
    deficit    double precision NOT NULL DEFAULT 0
        CONSTRAINT deficit_finite CHECK (deficit > '-Infinity'::float8 AND deficit < 'Infinity'::float8),
    PRIMARY KEY (tenant_id, priority),
    -- fairness by run time: moving average of its jobs' run seconds
    avg_job_seconds double precision
        CONSTRAINT avg_job_seconds_nonnegative CHECK (avg_job_seconds IS NULL OR avg_job_seconds >= 0)
        CONSTRAINT avg_job_seconds_finite CHECK (avg_job_seconds IS NULL OR (avg_job_seconds > '-Infinity'::float8 AND avg_job_seconds < 'Infinity'::float8)),
    -- Which kinds its runnable jobs may be of, so that a worker is only
    -- offered queues it can serve (queues.sql: `candidates`). A hint kept
    -- like has_work: every statement that makes a job pending adds its
    -- kind; only a pick that found nothing, under the row's lock, narrows
    -- it. Invariant: every pending job's kind is in `kinds`, or its
    -- run_after is at or after `kinds_due`. NULL: any kind (a row from
    -- before migration 0005, or more kinds than the hint holds).
    kinds      text[] CONSTRAINT kinds_bounded CHECK (kinds IS NULL OR cardinality(kinds) <= 64),
    kinds_due  timestamptz NOT NULL DEFAULT 'infinity'
);
CREATE INDEX queues_with_work ON queues (priority, tenant_id) WHERE has_work;

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

-- The round-robin position per priority class. The row is locked FOR UPDATE
-- for the length of one pick, which serialises picks of one class across all
-- dispatchers: that is what makes the schedule global.
CREATE TABLE scheduler (
    priority      text PRIMARY KEY CONSTRAINT scheduler_priority_known CHECK (priority IN ('interactive', 'default', 'bulk')),
    cursor_tenant text NOT NULL DEFAULT '',
    -- the cursor's queue had credit left for another batch when last served
    turn_open     boolean NOT NULL DEFAULT false
);
INSERT INTO scheduler (priority) VALUES ('interactive'), ('default'), ('bulk');

-- A batch is one lease: a dispatcher's time-limited claim on some jobs of one
-- tenant. batch_id is the fencing token (monotonic, never reused).
CREATE TABLE batches (
    batch_id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- no foreign key (migration 0014): a claim straight from the store may
    -- lease a tenant's jobs before a fold has made the tenant's row
    tenant_id        text NOT NULL,
    priority         text NOT NULL CONSTRAINT batch_priority_known CHECK (priority IN ('interactive', 'default', 'bulk')),
    worker_id        text NOT NULL CONSTRAINT worker_id_nonempty CHECK (worker_id <> ''),
    sandbox_driver   text NOT NULL,
    job_count        integer NOT NULL CONSTRAINT job_count_positive CHECK (job_count >= 1),
    lease_expires_at timestamptz NOT NULL,
    created_at       timestamptz NOT NULL,
    heartbeat_at     timestamptz NOT NULL,
    ended_at         timestamptz,
    outcome          text CONSTRAINT outcome_known CHECK (outcome IN ('ok', 'failed', 'released', 'lease_expired')),
    CONSTRAINT ended_has_outcome CHECK ((ended_at IS NULL) = (outcome IS NULL)),
    CONSTRAINT lease_after_creation CHECK (lease_expires_at >= created_at),
    -- measured run time of its jobs: the DRR cost with fairness by run time
    run_seconds      double precision CONSTRAINT run_seconds_nonnegative CHECK (run_seconds IS NULL OR run_seconds >= 0)
        CONSTRAINT run_seconds_finite CHECK (run_seconds IS NULL OR (run_seconds > '-Infinity'::float8 AND run_seconds < 'Infinity'::float8)),
    -- fairness by run time: the estimate charged when it was claimed
    charged_seconds  double precision
        CONSTRAINT charged_seconds_nonnegative CHECK (charged_seconds IS NULL OR charged_seconds >= 0)
        CONSTRAINT charged_seconds_finite CHECK (charged_seconds IS NULL OR (charged_seconds > '-Infinity'::float8 AND charged_seconds < 'Infinity'::float8)),
    -- network use through the egress proxy (allowed, blocked, bytes_out, bytes_in)
    egress           jsonb CONSTRAINT egress_is_object CHECK (egress IS NULL OR jsonb_typeof(egress) = 'object'),
    -- host-function calls, counted by the host (calls, errors, bytes_in, bytes_out, seconds)
    host_calls       jsonb CONSTRAINT host_calls_is_object CHECK (host_calls IS NULL OR jsonb_typeof(host_calls) = 'object')
);
-- live leases per tenant: occupancy (caps) is counted from here
CREATE INDEX batches_live ON batches (tenant_id) WHERE ended_at IS NULL;
CREATE INDEX batches_live_expiry ON batches (lease_expires_at) WHERE ended_at IS NULL;
-- Retention of ended batches, oldest first (migration 0011).
CREATE INDEX batches_ended ON batches (ended_at) WHERE ended_at IS NOT NULL;

CREATE TABLE jobs (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- no foreign key (migration 0014): the fold makes the tenant's row, so
    -- an enqueue neither checks nor locks it; the format is checked here
    tenant_id       text NOT NULL
        CONSTRAINT job_tenant_format CHECK (length(tenant_id) <= 128 AND tenant_id ~ '^[A-Za-z0-9][A-Za-z0-9._:@-]*$'),
    -- a star and a length test, not `{0,199}`: the regex engine walks a
    -- bounded repeat's 199 states for every row (migration 0010)
    kind            text NOT NULL
        CONSTRAINT kind_format CHECK (length(kind) <= 200 AND kind ~ '^[A-Za-z_][A-Za-z0-9_.:-]*$'),
    payload         jsonb NOT NULL,
    priority        text NOT NULL DEFAULT 'default'
        CONSTRAINT job_priority_known CHECK (priority IN ('interactive', 'default', 'bulk')),
    status          text NOT NULL DEFAULT 'pending'
        CONSTRAINT status_known CHECK (status IN ('pending', 'running', 'done', 'dead', 'cancelled')),
    attempts        integer NOT NULL DEFAULT 0,
    max_attempts    integer NOT NULL DEFAULT 5 CONSTRAINT max_attempts_positive CHECK (max_attempts >= 1),
    run_after       timestamptz NOT NULL,
    -- the lease this job runs under; the batch_id is the fencing token.
    -- No foreign key: one referential check per leased job was a quarter
    -- of the claim's time (migration 0013 says what keeps it true instead)
    batch_id        bigint,
    last_error      text,
    result          jsonb,
    idempotency_key text CONSTRAINT key_length CHECK (length(idempotency_key) BETWEEN 1 AND 255),
    created_at      timestamptz NOT NULL,
    started_at      timestamptz,
    finished_at     timestamptz,
    -- times sent back from dead (`tenantq dead retry`): attempts start again
    -- at 1, and the attempt history says which replay each belongs to
    replays         integer NOT NULL DEFAULT 0 CONSTRAINT replays_nonnegative CHECK (replays >= 0),
    -- the security envelope (migration 0006): who the job was enqueued for,
    -- and a small JSON object of request context; ctx.actor / ctx.meta
    actor           text
        CONSTRAINT actor_format CHECK (actor IS NULL OR (length(actor) BETWEEN 1 AND 200 AND actor !~ '[[:cntrl:]]')),
    meta            jsonb
        CONSTRAINT meta_is_object CHECK (meta IS NULL OR jsonb_typeof(meta) = 'object')
        CONSTRAINT meta_size CHECK (meta IS NULL OR octet_length(meta::text) <= 4096),
    -- who cancelled it; for a running job, when it was asked to stop (migration 0007)
    cancelled_by    text
        CONSTRAINT cancelled_by_format CHECK (cancelled_by IS NULL OR (length(cancelled_by) BETWEEN 1 AND 200 AND cancelled_by !~ '[[:cntrl:]]')),
    cancel_requested_at timestamptz,
    CONSTRAINT attempts_in_range CHECK (attempts BETWEEN 0 AND max_attempts),
    CONSTRAINT payload_size CHECK (octet_length(payload::text) <= 262144),
    CONSTRAINT running_has_lease CHECK ((status = 'running') = (batch_id IS NOT NULL)),
    CONSTRAINT running_was_attempted CHECK (status <> 'running' OR (attempts >= 1 AND started_at IS NOT NULL)),
    CONSTRAINT finished_iff_final CHECK ((status IN ('done', 'dead', 'cancelled')) = (finished_at IS NOT NULL)),
    CONSTRAINT dead_has_error CHECK (status <> 'dead' OR last_error IS NOT NULL)
);
-- The claim path: one tenant's runnable jobs of one class, oldest first.
CREATE INDEX jobs_runnable ON jobs (tenant_id, priority, run_after, id) WHERE status = 'pending';
-- Jobs of a lease, for settling, heartbeats and the reaper.
CREATE INDEX jobs_by_batch ON jobs (batch_id) WHERE batch_id IS NOT NULL;
-- Dead-letter listing and replay per tenant.
CREATE INDEX jobs_dead ON jobs (tenant_id, finished_at) WHERE status = 'dead';
CREATE UNIQUE INDEX jobs_idempotency ON jobs (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL;
-- Finding jobs (`tenantq jobs`, the dashboard's search): a tenant's jobs
-- newest first, and a tenant's jobs of one actor.
CREATE INDEX jobs_by_tenant ON jobs (tenant_id, created_at, id);
CREATE INDEX jobs_by_actor ON jobs (tenant_id, actor, created_at) WHERE actor IS NOT NULL;
-- Retention: a tenant's finished jobs, oldest first (jobs_dead serves `dead`).
CREATE INDEX jobs_done ON jobs (tenant_id, finished_at) WHERE status = 'done';
CREATE INDEX jobs_cancelled ON jobs (tenant_id, finished_at) WHERE status = 'cancelled';

-- Wake-ups (migration 0014): every statement that makes jobs pending
-- inserts a row per tenant, class and kind with the least run_after, and
-- touches no other shared row; workers fold them into `queues`
-- (queues.sql `fold`, under SKIP LOCKED). Constrained as the jobs are: a
-- row the fold could not write would fail every fold.
CREATE TABLE wakes (
    tenant_id text NOT NULL
        CONSTRAINT wake_tenant_format CHECK (length(tenant_id) <= 128 AND tenant_id ~ '^[A-Za-z0-9][A-Za-z0-9._:@-]*$'),
    priority  text NOT NULL CONSTRAINT wake_priority_known CHECK (priority IN ('interactive', 'default', 'bulk')),
    kind      text NOT NULL
        CONSTRAINT wake_kind_format CHECK (length(kind) <= 200 AND kind ~ '^[A-Za-z_][A-Za-z0-9_.:-]*$'),
    run_after timestamptz NOT NULL
);

-- Refused egress requests, attributed to the job that was running.
CREATE TABLE egress_blocks (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id  text NOT NULL,
    batch_id   bigint NOT NULL REFERENCES batches (batch_id) ON DELETE CASCADE,
    job_id     bigint,
    host       text NOT NULL CONSTRAINT egress_block_host_length CHECK (length(host) <= 300),
    reason     text NOT NULL CONSTRAINT egress_block_reason_length CHECK (length(reason) <= 1000),
    blocked_at timestamptz NOT NULL
);
CREATE INDEX egress_blocks_job ON egress_blocks (tenant_id, job_id);

-- Live workers: upserted when a worker starts, heartbeated by its
-- maintenance thread, deleted when it stops gracefully; dead after
-- WORKER_DEAD_AFTER_LEASES lease periods without a heartbeat (workers.sql),
-- then pruned.
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
    -- batches in a row whose executor failed, and the last such failure
    -- (kept after a success, for the record)
    executor_failures      integer NOT NULL DEFAULT 0
        CONSTRAINT executor_failures_nonnegative CHECK (executor_failures >= 0),
    last_executor_error    text,
    last_executor_error_at timestamptz,
    CONSTRAINT executor_error_has_time CHECK ((last_executor_error IS NULL) = (last_executor_error_at IS NULL))
);

-- One row per attempt that ended: done, failed, released before it started
-- (refunded, not counted) or lost with its lease. Written by the statements
-- that settle, release and reap, in their transactions; a running attempt
-- is the job row itself (started_at, batch). No foreign key: `jobs.prune`
-- deletes a job's attempts with it, and an FK on job_id would need an index
-- led by job_id for its cascade.
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
    outcome     text NOT NULL CONSTRAINT attempt_outcome_known CHECK (outcome IN ('done', 'failed', 'released', 'lost', 'cancelled')),
    error       text,
    -- its host-function calls (count, errors, seconds, the first calls listed)
    host_calls  jsonb CONSTRAINT attempt_host_calls_is_object CHECK (host_calls IS NULL OR jsonb_typeof(host_calls) = 'object'),
    CONSTRAINT attempt_failure_has_error CHECK (outcome NOT IN ('failed', 'lost') OR error IS NOT NULL),
    PRIMARY KEY (tenant_id, job_id, id)
);
-- "Recent failures" on the dashboard, newest first, for all tenants or one.
-- Partial: a successful attempt is in neither index.
CREATE INDEX attempts_failures ON attempts (finished_at) WHERE outcome IN ('failed', 'lost');
CREATE INDEX attempts_failures_by_tenant ON attempts (tenant_id, finished_at) WHERE outcome IN ('failed', 'lost');

-- Periodic jobs (migration 0007): one row per (tenant, schedule); see the
-- migration for the firing protocol (one job per fire time).
CREATE TABLE schedules (
    schedule_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id     text NOT NULL REFERENCES tenants (tenant_id) ON DELETE CASCADE,
    name          text NOT NULL CONSTRAINT schedule_name_length CHECK (length(name) BETWEEN 1 AND 300),
    kind          text NOT NULL CONSTRAINT schedule_kind_format CHECK (kind ~ '^[A-Za-z_][A-Za-z0-9_.:-]{0,199}$'),
    cron          text NOT NULL CONSTRAINT schedule_cron_length CHECK (length(cron) BETWEEN 1 AND 200),
    timezone      text NOT NULL DEFAULT 'UTC' CONSTRAINT schedule_timezone_length CHECK (length(timezone) BETWEEN 1 AND 64),
    payload       jsonb NOT NULL DEFAULT '{}'
        CONSTRAINT schedule_payload_is_object CHECK (jsonb_typeof(payload) = 'object')
        CONSTRAINT schedule_payload_size CHECK (octet_length(payload::text) <= 262144),
    priority      text NOT NULL DEFAULT 'default'
        CONSTRAINT schedule_priority_known CHECK (priority IN ('interactive', 'default', 'bulk')),
    max_attempts  integer NOT NULL DEFAULT 5 CONSTRAINT schedule_max_attempts_range CHECK (max_attempts BETWEEN 1 AND 1000),
    -- 'app': declared by @tenantq.periodic, kept in step by the workers; 'db': added at run time
    origin        text NOT NULL CONSTRAINT schedule_origin_known CHECK (origin IN ('app', 'db')),
    paused        boolean NOT NULL DEFAULT false,
    next_fire_at  timestamptz NOT NULL,
    last_fire_at  timestamptz,
    last_job_id   bigint,
    created_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT schedule_name_unique UNIQUE (tenant_id, name)
);
CREATE INDEX schedules_due ON schedules (next_fire_at) WHERE NOT paused;

-- Rate limits (migration 0007): token buckets shared by every worker, for
-- a tenant (kind ''), a tenant's kind, or a kind across tenants (tenant_id '').
CREATE TABLE rate_limits (
    tenant_id   text NOT NULL,
    kind        text NOT NULL,
    per_second  double precision NOT NULL
        CONSTRAINT per_second_finite CHECK (per_second > 0 AND per_second < 'Infinity'::float8),
    burst       double precision NOT NULL
        CONSTRAINT burst_finite CHECK (burst >= 1 AND burst < 'Infinity'::float8),
    tokens      double precision NOT NULL
        CONSTRAINT tokens_finite CHECK (tokens > '-Infinity'::float8 AND tokens < 'Infinity'::float8),
    refilled_at timestamptz NOT NULL,
    -- a kind's global bucket: the tenant that found it empty first gets
    -- the next token (until next_until), so tenants sharing the limit take
    -- turns instead of the first in rotation order taking every token
    next_tenant text,
    next_until  timestamptz,
    PRIMARY KEY (tenant_id, kind),
    CONSTRAINT rate_limit_has_scope CHECK (tenant_id <> '' OR kind <> '')
);

-- A queue's rows are inserted, updated twice and deleted within days:
-- with autovacuum's defaults (a vacuum once 20% of the table is dead,
-- throttled) the table and its indexes outgrow the live rows many times
-- over under a steady load (`./run bench soak`). Vacuum at 1% dead, without
-- the cost delay.
ALTER TABLE jobs SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.01,
                      autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0);
ALTER TABLE attempts SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.01,
                          autovacuum_vacuum_cost_delay = 0);
-- `batches` too: a row per claim, updated at its settle, kept for days
-- (migration 0009)
ALTER TABLE batches SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.01,
                         autovacuum_vacuum_cost_delay = 0);
-- 0012: vacuum never truncates these tables or their TOAST tables:
-- truncation takes an ACCESS EXCLUSIVE lock (every claim waits; a standby
-- cancels its queries), and a queue refills the pages it cut off within
-- seconds
ALTER TABLE jobs SET (vacuum_truncate = false, toast.vacuum_truncate = false);
ALTER TABLE attempts SET (vacuum_truncate = false, toast.vacuum_truncate = false);
ALTER TABLE batches SET (vacuum_truncate = false, toast.vacuum_truncate = false);
-- 0014: `wakes` is inserted and deleted within milliseconds: vacuum after a
-- few hundred dead rows, and never truncate (every enqueue would wait
-- behind the ACCESS EXCLUSIVE lock)
ALTER TABLE wakes SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 500,
                       autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 500,
                       autovacuum_vacuum_cost_delay = 0, vacuum_truncate = false);
