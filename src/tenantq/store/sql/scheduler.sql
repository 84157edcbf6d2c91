-- Statements about the round-robin position per priority class.

-- name: lock_cursor
-- Serialises picks of one class across every dispatcher for the length of
-- one claim transaction. Picks are per batch, not per job, so this row sees
-- a few hundred locks a second at most.
SELECT cursor_tenant, turn_open FROM scheduler WHERE priority = %(priority)s FOR UPDATE;

-- name: advance_cursor
UPDATE scheduler SET cursor_tenant = %(tenant_id)s, turn_open = %(turn_open)s
WHERE priority = %(priority)s;
