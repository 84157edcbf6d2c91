-- Statements about workers: the registry of live workers (which kinds
-- each serves, on which sandbox driver, and its executor's last failure).
-- A worker is live while its heartbeat is younger than
-- WORKER_DEAD_AFTER_LEASES (3) of its lease periods: its maintenance thread
-- beats three times per lease period, so a worker is called dead only
-- after missing about nine beats in a row.

-- name: beat
-- Upserted when a worker starts and on every maintenance tick: a row that
-- was pruned (a worker paused for a day) comes back. started_at is kept.
INSERT INTO workers AS w (worker_id, host, pid, kinds, sandbox_driver, lease_seconds, started_at,
                          heartbeat_at)
VALUES (%(worker_id)s, %(host)s, %(pid)s, %(kinds)s::text[], %(driver)s, %(lease_seconds)s,
        coalesce(%(now)s::timestamptz, now()), coalesce(%(now)s::timestamptz, now()))
ON CONFLICT (worker_id) DO UPDATE
SET heartbeat_at = excluded.heartbeat_at, kinds = excluded.kinds, sandbox_driver = excluded.sandbox_driver,
    lease_seconds = excluded.lease_seconds;

-- name: leave
-- A graceful stop: the worker is gone at once, not after its heartbeat ages.
DELETE FROM workers WHERE worker_id = %(worker_id)s;

-- name: executor_failed
UPDATE workers
SET executor_failures = executor_failures + 1, last_executor_error = %(error)s,
    last_executor_error_at = coalesce(%(now)s::timestamptz, now())
WHERE worker_id = %(worker_id)s;

-- name: executor_ok
-- The first batch that ran after failures; the last error stays for the record.
UPDATE workers SET executor_failures = 0 WHERE worker_id = %(worker_id)s AND executor_failures > 0;

-- name: live
-- The live workers, oldest first. A small table (one row per worker
-- process), read by `tenantq job` and the dashboard only.
SELECT worker_id, host, pid, kinds, sandbox_driver, lease_seconds, started_at, heartbeat_at,
       executor_failures, last_executor_error, last_executor_error_at
FROM workers
WHERE heartbeat_at > coalesce(%(now)s::timestamptz, now()) - make_interval(secs => 3 * lease_seconds)
ORDER BY started_at, worker_id;

-- name: prune
-- Rows of workers dead for longer than %(keep_seconds)s (killed, never
-- stopped gracefully).
DELETE FROM workers
WHERE heartbeat_at < coalesce(%(now)s::timestamptz, now())
                     - make_interval(secs => 3 * lease_seconds + %(keep_seconds)s);
