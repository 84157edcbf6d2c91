-- 0009: `batches` is vacuumed like `jobs`. Every claim inserts a row and
-- every settle updates it, and ended batches are kept for days, so the
-- table only grows while a soak runs: with autovacuum's default 20% it was
-- vacuumed ever more rarely (18 times in 22 minutes, `jobs` 132), and its
-- partial indexes of live batches (ended_at IS NULL) held ever more dead
-- entries for the lease reaper and the caps to step over.
ALTER TABLE batches SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.01,
                         autovacuum_vacuum_cost_delay = 0);
