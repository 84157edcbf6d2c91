-- Statements for "why is this job waiting".

-- name: job
SELECT extract(epoch FROM j.run_after - now())::double precision AS future_seconds,
       t.max_sandboxes,
       (SELECT count(*) FROM batches b
        WHERE b.tenant_id = j.tenant_id AND b.ended_at IS NULL AND b.lease_expires_at > now()) AS live_batches,
       (SELECT count(*) FROM jobs a
        WHERE a.tenant_id = j.tenant_id AND a.priority = j.priority AND a.status = 'pending'
          AND a.run_after <= now() AND (a.run_after, a.id) < (j.run_after, j.id)) AS ahead_same_tenant
FROM jobs j JOIN tenants t USING (tenant_id)
WHERE j.id = %(id)s;
