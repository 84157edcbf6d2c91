-- 0002: deficit round robin state and measured batch cost.

-- The scheduler's cursor queue may still be in the middle of its turn (it
-- had credit left for another batch when it was last served).
ALTER TABLE scheduler ADD COLUMN turn_open boolean NOT NULL DEFAULT false;

-- Measured run time of a batch's jobs: the cost charged to the queue's
-- deficit when fairness is by run time, and part of the batch record.
ALTER TABLE batches ADD COLUMN run_seconds double precision
    CONSTRAINT run_seconds_nonnegative CHECK (run_seconds IS NULL OR run_seconds >= 0);

-- Fairness by run time charges an estimate when a batch is claimed (the
-- queue's average job seconds times the jobs claimed) and corrects it with
-- the measured run time when the batch ends.
ALTER TABLE queues ADD COLUMN avg_job_seconds double precision
    CONSTRAINT avg_job_seconds_nonnegative CHECK (avg_job_seconds IS NULL OR avg_job_seconds >= 0);
ALTER TABLE batches ADD COLUMN charged_seconds double precision
    CONSTRAINT charged_seconds_nonnegative CHECK (charged_seconds IS NULL OR charged_seconds >= 0);
