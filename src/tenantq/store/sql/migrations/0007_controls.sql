-- 0007: operating tenants over months: periodic jobs (schedules), pausing
-- a tenant, cancelling running work, and retention.

-- A paused tenant's queues are skipped by the pick (queues.sql
-- `candidates`); its running batches finish. NULL: not paused.
ALTER TABLE tenants ADD COLUMN paused_at timestamptz;
-- Retention overrides, seconds (NULL: the worker's defaults,
-- TENANTQ_RETAIN_DONE / _CANCELLED / _DEAD).
ALTER TABLE tenants ADD COLUMN retain_done_seconds double precision
    CONSTRAINT retain_done_seconds_finite CHECK (retain_done_seconds IS NULL OR (retain_done_seconds >= 0 AND retain_done_seconds < 'Infinity'::float8));
ALTER TABLE tenants ADD COLUMN retain_cancelled_seconds double precision
    CONSTRAINT retain_cancelled_seconds_finite CHECK (retain_cancelled_seconds IS NULL OR (retain_cancelled_seconds >= 0 AND retain_cancelled_seconds < 'Infinity'::float8));
ALTER TABLE tenants ADD COLUMN retain_dead_seconds double precision
    CONSTRAINT retain_dead_seconds_finite CHECK (retain_dead_seconds IS NULL OR (retain_dead_seconds >= 0 AND retain_dead_seconds < 'Infinity'::float8));

-- Who cancelled a job; for a running one, when it was asked to stop (its
-- worker stops it and settles it `cancelled`).
ALTER TABLE jobs ADD COLUMN cancelled_by text
    CONSTRAINT cancelled_by_format CHECK (cancelled_by IS NULL OR (length(cancelled_by) BETWEEN 1 AND 200 AND cancelled_by !~ '[[:cntrl:]]'));
ALTER TABLE jobs ADD COLUMN cancel_requested_at timestamptz;
-- an attempt stopped by a cancel ends `cancelled`
ALTER TABLE attempts DROP CONSTRAINT attempt_outcome_known;
ALTER TABLE attempts ADD CONSTRAINT attempt_outcome_known
    CHECK (outcome IN ('done', 'failed', 'released', 'lost', 'cancelled'));

-- Retention: a tenant's finished jobs, oldest first, one partial index per
-- final status (jobs_dead already serves `dead`); tenant_id leads, so the
-- pruner walks each tenant with its own window (jobs.sql `prune_expired`).
CREATE INDEX IF NOT EXISTS jobs_done ON jobs (tenant_id, finished_at) WHERE status = 'done';
CREATE INDEX IF NOT EXISTS jobs_cancelled ON jobs (tenant_id, finished_at) WHERE status = 'cancelled';

-- Periodic jobs: one row per (tenant, schedule). `origin` 'app' rows are
-- declared by @tenantq.periodic and kept in step by every worker that
-- loads the app; 'db' rows are added at run time (`tenantq schedule add`).
-- The worker that fires a due schedule locks its row (SKIP LOCKED) and,
-- in the same transaction, enqueues the job with the idempotency key
-- `schedule:<id>:<fire time>` and moves next_fire_at: one job per fire
-- time however many workers run.
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
    origin        text NOT NULL CONSTRAINT schedule_origin_known CHECK (origin IN ('app', 'db')),
    paused        boolean NOT NULL DEFAULT false,
    next_fire_at  timestamptz NOT NULL,
    last_fire_at  timestamptz,
    last_job_id   bigint,
    created_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT schedule_name_unique UNIQUE (tenant_id, name)
);
CREATE INDEX schedules_due ON schedules (next_fire_at) WHERE NOT paused;

-- Rate limits: token buckets shared by every worker. A row limits a
-- tenant (kind ''), a tenant's kind, or a kind across every tenant
-- (tenant_id ''). `tokens` is the bucket as of `refilled_at`; readers add
-- per_second * elapsed, capped at burst (rate_limits.sql `available`).
-- The pick skips a tenant with no token and sizes its batch by its tokens,
-- then takes them, in the pick's transaction (fairness/picker.py).
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
