-- Statements about rate limits (schema.sql `rate_limits`): token buckets.
-- A bucket's tokens now: least(burst, tokens + per_second * seconds since
-- refilled_at), written out in each statement that needs it.

-- name: set
-- Set or change a limit; a new bucket starts full, a changed one keeps
-- its tokens (capped at the new burst).
INSERT INTO rate_limits AS r (tenant_id, kind, per_second, burst, tokens, refilled_at)
VALUES (%(tenant_id)s, %(kind)s, %(per_second)s, %(burst)s, %(burst)s, now())
ON CONFLICT (tenant_id, kind) DO UPDATE
SET tokens = least(excluded.burst, r.tokens + r.per_second * greatest(0, extract(epoch FROM now() - r.refilled_at))),
    refilled_at = greatest(r.refilled_at, now()), per_second = excluded.per_second, burst = excluded.burst
RETURNING tenant_id, kind, per_second, burst, tokens;

-- name: clear
DELETE FROM rate_limits WHERE tenant_id = %(tenant_id)s AND kind = %(kind)s RETURNING tenant_id;

-- name: list
SELECT tenant_id, kind, per_second, burst,
       least(burst, tokens + per_second * greatest(0, extract(epoch FROM now() - refilled_at))) AS tokens
FROM rate_limits
WHERE %(tenant_id)s::text IS NULL OR tenant_id IN (%(tenant_id)s, '')
ORDER BY tenant_id, kind;

-- name: for_claim
-- The buckets that bound a batch of this tenant: its own, its kinds', and
-- the kinds' global ones, locked in key order until the pick commits, so
-- two picks (of different priority classes) cannot spend one token twice.
-- Lock order: scheduler row, these rows, the tenant row (caps), jobs.
SELECT tenant_id, kind,
       least(burst, tokens + per_second * greatest(0, extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - refilled_at))) AS tokens,
       per_second,
       -- another tenant holds the turn for this kind's next token
       (next_tenant IS NOT NULL AND next_tenant <> %(tenant_id)s
        AND next_until > coalesce(%(now)s::timestamptz, now())) AS others_turn
FROM rate_limits
WHERE (tenant_id = %(tenant_id)s OR tenant_id = '')
  AND (kind = '' OR %(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
ORDER BY tenant_id, kind
FOR UPDATE;

-- name: take
-- Spend the tokens a claim used (a bucket may dip below zero only by
-- rounding; it refills from there).
UPDATE rate_limits r
SET tokens = least(r.burst, r.tokens + r.per_second * greatest(0, extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - r.refilled_at))) - t.n,
    -- never back in time: a pick's clock is its transaction's start, which
    -- may be older than the last refill another pick wrote
    refilled_at = greatest(r.refilled_at, coalesce(%(now)s::timestamptz, now()))
FROM unnest(%(tenant_ids)s::text[], %(kinds)s::text[], %(ns)s::double precision[]) AS t(tenant_id, kind, n)
WHERE r.tenant_id = t.tenant_id AND r.kind = t.kind;

-- name: wait_turn
-- The tenant found these kinds' global buckets empty: unless another
-- tenant holds the turn, it takes the turn for the next token (for twice
-- the time a token takes to come, at least a second).
UPDATE rate_limits
SET next_tenant = %(tenant_id)s,
    next_until = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => greatest(1.0, 2.0 / per_second))
WHERE tenant_id = '' AND kind = ANY(%(kinds)s::text[])
  AND (next_tenant IS NULL OR next_until <= coalesce(%(now)s::timestamptz, now()));

-- name: turn_taken
UPDATE rate_limits SET next_tenant = NULL, next_until = NULL
WHERE tenant_id = '' AND kind = ANY(%(kinds)s::text[]) AND next_tenant = %(tenant_id)s;

-- name: for_job
-- What limits a pending job (`tenantq job ID`): the buckets of its tenant and kind.
SELECT tenant_id, kind, per_second, burst,
       least(burst, tokens + per_second * greatest(0, extract(epoch FROM now() - refilled_at))) AS tokens
FROM rate_limits
WHERE (tenant_id = %(tenant_id)s AND kind IN ('', %(kind)s)) OR (tenant_id = '' AND kind = %(kind)s);
