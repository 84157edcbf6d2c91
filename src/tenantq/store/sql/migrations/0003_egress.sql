-- 0003: per-tenant egress policy and its accounting.

-- The hosts a tenant's sandboxed jobs may reach through the egress proxy
-- (`api.stripe.com`, `*.salesforce.com:443`); empty = no network at all.
-- Rules are validated by tenantq before they get here; the count is bounded.
ALTER TABLE tenants ADD COLUMN egress text[] NOT NULL DEFAULT '{}'
    CONSTRAINT egress_rule_count CHECK (cardinality(egress) <= 64);

-- What the batch's sandbox did on the network: requests allowed / blocked,
-- bytes out / in. NULL: the batch had no egress proxy.
ALTER TABLE batches ADD COLUMN egress jsonb
    CONSTRAINT egress_is_object CHECK (egress IS NULL OR jsonb_typeof(egress) = 'object');

-- Refused requests, attributed to the job that was running (shown on the
-- job's page). Bounded per batch by the proxy; cascades with the batch.
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
