-- 0002: deficit round robin state and measured batch cost.

-- The scheduler's cursor queue may still be in the middle of its turn (it
-- had credit left for another batch when it was last served).
ALTER TABLE scheduler ADD COLUMN turn_open boolean NOT NULL DEFAULT false;

-- Measured run time of a batch's jobs: the cost charged to the queue's
-- deficit when fairness is by run time, and part of the batch record.
ALTER TABLE batches ADD COLUMN run_seconds double precision
    CONSTRAINT run_seconds_nonnegative CHECK (run_seconds IS NULL OR run_seconds >= 0);
