-- 0012: vacuum never truncates the queue's tables or their TOAST tables.
-- Truncating a table's empty tail takes an ACCESS EXCLUSIVE lock on it:
-- every claim and settle that comes meanwhile waits until vacuum notices
-- the waiter and lets go, and on a standby the replayed lock cancels the
-- standby's queries. A queue's tables are at a steady size under steady
-- traffic: the pages cut off were filled again a few seconds later, so
-- truncating bought nothing but the lock and the re-extension (the soak's
-- `jobs` went 46 -> 32 -> 40 MB within 90 s, docs/retention.md "Vacuum").
-- The space of deleted rows is still reused; to give it back to the
-- operating system after a one-off burst, run
-- `VACUUM (TRUNCATE) <schema>.jobs` by hand.
ALTER TABLE jobs SET (vacuum_truncate = false, toast.vacuum_truncate = false);
ALTER TABLE attempts SET (vacuum_truncate = false, toast.vacuum_truncate = false);
ALTER TABLE batches SET (vacuum_truncate = false, toast.vacuum_truncate = false);
