-- 0006: the job's security envelope (who asked for it), and finding jobs.

-- Who the job was enqueued for (a user id, a service account...), so that a
-- worker can restore the request's context (`ctx.actor`). One printable line.
ALTER TABLE jobs ADD COLUMN actor text
    CONSTRAINT actor_format CHECK (actor IS NULL OR (length(actor) BETWEEN 1 AND 200 AND actor !~ '[[:cntrl:]]'));
-- Small request context (request id, plan, ...): `ctx.meta`. A JSON object
-- of at most 4 KiB as Postgres renders it (validation.py mirrors both).
ALTER TABLE jobs ADD COLUMN meta jsonb
    CONSTRAINT meta_is_object CHECK (meta IS NULL OR jsonb_typeof(meta) = 'object')
    CONSTRAINT meta_size CHECK (meta IS NULL OR octet_length(meta::text) <= 4096);

-- Finding jobs (`tenantq jobs`, the dashboard's search): a tenant's jobs
-- newest first, and a tenant's jobs of one actor. Both lead with tenant_id,
-- like every hot index (tests/fairness/test_query_plans.py). CREATE INDEX
-- (not CONCURRENTLY: migrations run in a transaction) blocks writes to jobs
-- while it builds; on a large table, build them CONCURRENTLY by hand first
-- with these names and the migration skips them.
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant_id, created_at, id);
CREATE INDEX IF NOT EXISTS jobs_by_actor ON jobs (tenant_id, actor, created_at) WHERE actor IS NOT NULL;
