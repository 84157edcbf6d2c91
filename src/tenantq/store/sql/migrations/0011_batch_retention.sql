-- 0011: ended batches are pruned by TENANTQ_RETAIN_BATCHES (default 7 days)
-- in chunks, oldest first, by every worker's maintenance loop; this index
-- finds them without reading the live ones. (Before, one DELETE an hour.)
CREATE INDEX batches_ended ON batches (ended_at) WHERE ended_at IS NOT NULL;
