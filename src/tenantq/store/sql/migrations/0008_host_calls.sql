-- 0008: host functions (docs/tenant-data.md): a tenant's own restriction
-- of the host functions its handlers may call, and what the calls cost,
-- per batch and per attempt.

-- NULL: every host function its handlers declare; an array: only these
-- (empty: none). Travels with each claimed batch, like `egress`.
ALTER TABLE tenants ADD COLUMN host_functions text[]
    CONSTRAINT host_function_count CHECK (host_functions IS NULL OR cardinality(host_functions) <= 256);
-- The batch's calls: {"calls", "errors", "bytes_in", "bytes_out", "seconds"},
-- counted by the host (never the guest's say), written with its end.
ALTER TABLE batches ADD COLUMN host_calls jsonb
    CONSTRAINT host_calls_is_object CHECK (host_calls IS NULL OR jsonb_typeof(host_calls) = 'object');
-- The attempt's calls: {"count", "errors", "seconds", "calls": [{"name",
-- "outcome", "ms"}, ...]}, the first MAX_RECORDED_CALLS of them listed.
ALTER TABLE attempts ADD COLUMN host_calls jsonb
    CONSTRAINT attempt_host_calls_is_object CHECK (host_calls IS NULL OR jsonb_typeof(host_calls) = 'object');
