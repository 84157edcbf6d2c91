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
    egress        text[] NOT NULL DEFAULT '{}' CONSTRAINT egress_rule_count CHECK (cardinality(egress) <= 64)
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
        CONSTRAINT avg_job_seconds_finite CHECK (avg_job_seconds IS NULL OR (avg_job_seconds > '-Infinity'::float8 AND avg_job_seconds < 'Infinity'::float8))
);
CREATE INDEX queues_with_work ON queues (priority, tenant_id) WHERE has_work;

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
    tenant_id        text NOT NULL REFERENCES tenants (tenant_id) ON DELETE CASCADE,
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
    egress           jsonb CONSTRAINT egress_is_object CHECK (egress IS NULL OR jsonb_typeof(egress) = 'object')
);
-- live leases per tenant: occupancy (caps) is counted from here
CREATE INDEX batches_live ON batches (tenant_id) WHERE ended_at IS NULL;
CREATE INDEX batches_live_expiry ON batches (lease_expires_at) WHERE ended_at IS NULL;

CREATE TABLE jobs (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id       text NOT NULL REFERENCES tenants (tenant_id) ON DELETE CASCADE,
    kind            text NOT NULL CONSTRAINT kind_format CHECK (kind ~ '^[A-Za-z_][A-Za-z0-9_.:-]{0,199}$'),
    payload         jsonb NOT NULL,
    priority        text NOT NULL DEFAULT 'default'
        CONSTRAINT job_priority_known CHECK (priority IN ('interactive', 'default', 'bulk')),
    status          text NOT NULL DEFAULT 'pending'
        CONSTRAINT status_known CHECK (status IN ('pending', 'running', 'done', 'dead', 'cancelled')),
    attempts        integer NOT NULL DEFAULT 0,
    max_attempts    integer NOT NULL DEFAULT 5 CONSTRAINT max_attempts_positive CHECK (max_attempts >= 1),
    run_after       timestamptz NOT NULL,
    -- the lease this job runs under; the batch_id is the fencing token
    batch_id        bigint REFERENCES batches (batch_id) ON DELETE SET NULL,
    last_error      text,
    result          jsonb,
    idempotency_key text CONSTRAINT key_length CHECK (length(idempotency_key) BETWEEN 1 AND 255),
    created_at      timestamptz NOT NULL,
    started_at      timestamptz,
    finished_at     timestamptz,
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
