"""Per-tenant egress: the policy (which hosts a tenant's jobs may reach) and
the host-side proxy each sandboxed batch reaches the network through."""
