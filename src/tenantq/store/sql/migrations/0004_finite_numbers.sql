-- 0004: every float column holds a finite number.
--
-- A double precision column accepts NaN and ±Infinity, and NaN passes a
-- `>= 0` CHECK (Postgres sorts NaN above every number, Infinity included).
-- A job that reported `"seconds": NaN` got it stored in batches.run_seconds,
-- and the runtime charge spread it into its queue's deficit and average,
-- where it broke every later pick of that class. The `_finite` constraints
-- reject NaN and both infinities: `x > '-Infinity' AND x < 'Infinity'` is
-- false for NaN (NaN < 'Infinity' is false) and for ±Infinity. The
-- `_nonnegative` constraints stay as they are.

-- No pick, claim or settle may write between the repair and the checks.
-- Lock order as everywhere else: queues before batches.
LOCK TABLE queues, batches IN ACCESS EXCLUSIVE MODE;

-- Repair rows written before the checks existed: a poisoned deficit loses
-- its credit or debt, a poisoned average is forgotten (the next batch
-- starts it afresh), and a batch's recorded cost becomes 0.
UPDATE queues SET deficit = 0
WHERE NOT (deficit > '-Infinity'::float8 AND deficit < 'Infinity'::float8);
UPDATE queues SET avg_job_seconds = NULL
WHERE NOT (avg_job_seconds > '-Infinity'::float8 AND avg_job_seconds < 'Infinity'::float8);
UPDATE batches SET run_seconds = 0
WHERE NOT (run_seconds > '-Infinity'::float8 AND run_seconds < 'Infinity'::float8);
UPDATE batches SET charged_seconds = 0
WHERE NOT (charged_seconds > '-Infinity'::float8 AND charged_seconds < 'Infinity'::float8);

ALTER TABLE queues ADD CONSTRAINT deficit_finite
    CHECK (deficit > '-Infinity'::float8 AND deficit < 'Infinity'::float8);
ALTER TABLE queues ADD CONSTRAINT avg_job_seconds_finite
    CHECK (avg_job_seconds IS NULL OR (avg_job_seconds > '-Infinity'::float8 AND avg_job_seconds < 'Infinity'::float8));
ALTER TABLE batches ADD CONSTRAINT run_seconds_finite
    CHECK (run_seconds IS NULL OR (run_seconds > '-Infinity'::float8 AND run_seconds < 'Infinity'::float8));
ALTER TABLE batches ADD CONSTRAINT charged_seconds_finite
    CHECK (charged_seconds IS NULL OR (charged_seconds > '-Infinity'::float8 AND charged_seconds < 'Infinity'::float8));
