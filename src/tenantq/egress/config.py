"""What a host's egress proxies are configured with, and where a sandbox
finds its proxy (for the queue's batches: dispatch/executors/egress.py; for
Sandbox API sandboxes: sandbox/api_egress.py)."""

from __future__ import annotations

from dataclasses import dataclass

SOCKET_NAME = "proxy.sock"
CA_NAME = "ca.pem"


@dataclass(frozen=True)
class EgressConfig:
    # networks the proxy may connect to although they are internal (tests,
    # deliberate setups); TENANTQ_EGRESS_ALLOW_NETWORKS
    allow_networks: tuple[str, ...] = ()
    # one more CA file to trust for upstream TLS; TENANTQ_EGRESS_UPSTREAM_CA
    upstream_ca: str | None = None
    # distinct host names one batch may ask for (rule E3); TENANTQ_EGRESS_MAX_NAMES_PER_BATCH
    max_names_per_batch: int = 256

    @classmethod
    def from_settings(cls) -> EgressConfig:
        from tenantq.settings import Settings

        settings = Settings()
        return cls(tuple(settings.egress_networks()), settings.egress_upstream_ca,
                   settings.egress_max_names_per_batch)
