-- Statements about the round-robin position per priority class.

-- name: decide_quickly
-- First statement of a pick's decision (fairness/picker.py): the decision
-- writes only the round robin's state (cursor, deficits), never a job, so
-- its commit need not wait for the WAL flush, and the cursor lock it holds
-- is released that much sooner. A crash of Postgres can lose the last few
-- decisions (a tenant's place in the rotation, one turn's credit), never a
-- claim: the claim that follows a decision commits synchronously, and its
-- WAL flush covers the decision's commit record before it.
SET LOCAL synchronous_commit = off;

-- name: lock_cursor
-- Serialises the decisions of one class across every dispatcher: the lock
-- is held from here to the decision's commit, which writes the cursor and
-- the deficits; the claim runs after it, without the lock.
SELECT cursor_tenant, turn_open FROM scheduler WHERE priority = %(priority)s FOR UPDATE;

-- name: advance_cursor
UPDATE scheduler SET cursor_tenant = %(tenant_id)s, turn_open = %(turn_open)s
WHERE priority = %(priority)s;
