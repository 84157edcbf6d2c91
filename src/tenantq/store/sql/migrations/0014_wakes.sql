-- 0014: producers write only rows of their own (issue "producer-path").
--
-- Until now an enqueue upserted its queue's row (`queues`) and, through
-- the foreign key, share-locked its tenant's row, in the caller's
-- transaction: `ON CONFLICT DO UPDATE` locks the conflicting row even when
-- it changes nothing, and holds it to the caller's COMMIT. A second
-- producer of the tenant waited for that COMMIT, and so did the worker
-- whose decision added to the queue's deficit, holding its class's cursor,
-- and every worker behind it.
--
-- Now a statement that makes jobs pending (enqueue, COPY, a retry, a
-- release, a reap, a replay) inserts one `wakes` row per tenant, class
-- and kind with the least run_after, and touches no other shared row.
-- Workers fold the wakes into `queues` (queues.sql `fold`): a wake is
-- visible exactly when its jobs are (one commit), is gone with them on
-- rollback, and stays until a fold deletes it under SKIP LOCKED.
--
-- jobs.tenant_id no longer references tenants: the fold makes the tenant's
-- row, so an enqueue neither checks nor locks it. The id's format, which
-- the tenants table checked for it, is checked on the job (and on its
-- wake: a row the fold could not insert would fail every fold).
-- batches.tenant_id no longer references tenants either: a claim straight
-- from the store (jobs.claim) may lease a tenant's jobs before any fold has
-- made its row, and nothing reads a batch through its tenant's row.
ALTER TABLE jobs DROP CONSTRAINT jobs_tenant_id_fkey;
ALTER TABLE batches DROP CONSTRAINT batches_tenant_id_fkey;
ALTER TABLE jobs ADD CONSTRAINT job_tenant_format
    CHECK (length(tenant_id) <= 128 AND tenant_id ~ '^[A-Za-z0-9][A-Za-z0-9._:@-]*$') NOT VALID;
ALTER TABLE jobs VALIDATE CONSTRAINT job_tenant_format;

CREATE TABLE wakes (
    tenant_id text NOT NULL
        CONSTRAINT wake_tenant_format CHECK (length(tenant_id) <= 128 AND tenant_id ~ '^[A-Za-z0-9][A-Za-z0-9._:@-]*$'),
    priority  text NOT NULL CONSTRAINT wake_priority_known CHECK (priority IN ('interactive', 'default', 'bulk')),
    kind      text NOT NULL
        CONSTRAINT wake_kind_format CHECK (length(kind) <= 200 AND kind ~ '^[A-Za-z_][A-Za-z0-9_.:-]*$'),
    run_after timestamptz NOT NULL
);
-- Inserted and deleted within milliseconds: vacuum after a few hundred dead
-- rows, without the cost delay, and never truncate (truncation takes an
-- ACCESS EXCLUSIVE lock, which every enqueue would wait behind).
ALTER TABLE wakes SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 500,
                       autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 500,
                       autovacuum_vacuum_cost_delay = 0, vacuum_truncate = false);
