-- Statements for "why is this job waiting". Only `tenantq job` and the
-- dashboard run these; the claim path never does.

-- name: job
SELECT extract(epoch FROM j.run_after - now())::double precision AS future_seconds,
       t.max_sandboxes, t.weight, t.paused_at,
       q.deficit, q.has_work,
       (SELECT count(*) FROM batches b
        WHERE b.tenant_id = j.tenant_id AND b.ended_at IS NULL AND b.lease_expires_at > now()) AS live_batches,
       (SELECT count(*) FROM jobs a
        WHERE a.tenant_id = j.tenant_id AND a.priority = j.priority AND a.status = 'pending'
          AND a.run_after <= now() AND (a.run_after, a.id) < (j.run_after, j.id)) AS ahead_same_tenant,
       (SELECT count(*) FROM queues o
        WHERE o.priority = j.priority AND o.has_work AND o.tenant_id <> j.tenant_id
          AND o.next_run_at <= now()) AS other_queues,
       (SELECT array_agg(h.priority ORDER BY h.priority) FROM queues h
        WHERE h.has_work AND h.next_run_at <= now()
          AND (h.priority = 'interactive' AND j.priority <> 'interactive'
               OR h.priority = 'default' AND j.priority = 'bulk')) AS classes_first,
       (SELECT count(*) FROM batches r WHERE r.ended_at IS NULL AND r.lease_expires_at > now()) AS running_batches
FROM jobs j
JOIN tenants t USING (tenant_id)
LEFT JOIN queues q ON q.tenant_id = j.tenant_id AND q.priority = j.priority
WHERE j.id = %(id)s;
