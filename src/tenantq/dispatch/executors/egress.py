"""A sandboxed batch's way out: when its tenant has egress rules, the batch
gets its own proxy (tenantq/egress/proxy.py) on a socket in the sandbox's
egress dir, which only that sandbox has bound in. The proxy knows the batch's
tenant and rules, and which job is running (to apply the handler's narrowing
and to attribute refusals); it is closed, and every connection through it
cut, when the batch ends, so a kept-warm sandbox's next batch gets a new one.

Secrets marked for injection never reach the sandbox: its environment holds
a placeholder made for this batch, and the proxy (terminating TLS with the
tenant's CA, whose certificate is put next to the socket) swaps in the value
on requests to the hosts the secret is meant for.
"""

from __future__ import annotations

import secrets as random_tokens
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from tenantq.dispatch.executors.contract import EgressUsed
from tenantq.domain.records import Batch
from tenantq.egress.config import CA_NAME, SOCKET_NAME, EgressConfig
from tenantq.egress.inject import Injection
from tenantq.egress.policy import EgressPolicy, Rule, parse_rules
from tenantq.egress.proxy import AddressGuard, BatchProxy, EgressHub
from tenantq.egress.tls import CAStore, upstream_context
from tenantq.observe import metrics
from tenantq.registry import Registry
from tenantq.sandbox.driver import DriverSandbox
from tenantq.secrets import NoSecrets, SecretsProvider


class EgressProxies:
    def __init__(self, registry: Registry, data_dir: Path, config: EgressConfig | None = None,
                 secrets: SecretsProvider | None = None) -> None:
        self.registry = registry
        self._config = config
        self.secrets: SecretsProvider = secrets or NoSecrets()
        self.cas = CAStore(data_dir / "egress-ca")
        self._hub: EgressHub | None = None
        self._lock = threading.Lock()

    def _get_hub(self) -> EgressHub:
        with self._lock:
            if self._hub is None:
                config = self._config or EgressConfig.from_settings()
                guard = AddressGuard(config.allow_networks)
                self._hub = EgressHub(guard, upstream_context(config.upstream_ca), config.max_names_per_batch)
            return self._hub

    def open(self, sandbox: DriverSandbox, batch: Batch, running_now: Callable[[], int | None],
             env: Mapping[str, str]) -> tuple[BatchProxy | None, dict[str, str]]:
        """The batch's proxy (None when its tenant allows no egress), and the
        environment its sandbox gets: injected secrets as placeholders."""
        env = dict(env)
        injections = []
        for secret in self.secrets.injected(batch.tenant_id):
            placeholder = f"tenantq-placeholder-{secret.name}-{random_tokens.token_hex(16)}"
            env[secret.name] = placeholder
            injections.append(Injection(secret.name, secret.value, placeholder, secret.rule, secret.header,
                                        secret.template))
        ca_file = sandbox.egress_dir / CA_NAME
        if not batch.egress:
            ca_file.unlink(missing_ok=True)
            return None, env
        ca = self.cas.for_tenant(batch.tenant_id) if injections else None
        if ca is not None:
            ca_file.write_bytes(ca.cert_pem)
        else:
            ca_file.unlink(missing_ok=True)
        policy = EgressPolicy(batch.tenant_id, parse_rules(batch.egress))
        kinds = {j.id: j.kind for j in batch.jobs}
        tenant = batch.tenant_id

        def current_job() -> tuple[int | None, tuple[Rule, ...] | None]:
            job_id = running_now()
            handler = self.registry.get(kinds[job_id]) if job_id in kinds else None
            return job_id, handler.egress if handler is not None else None

        def on_event(outcome: str, detail: str, amount: int) -> None:
            if outcome == "bytes":
                metrics.EGRESS_BYTES.labels(tenant, detail).inc(amount)
            else:
                metrics.EGRESS_REQUESTS.labels(tenant, outcome).inc(amount)

        proxy = self._get_hub().open(sandbox.egress_dir / SOCKET_NAME, policy, current_job, on_event,
                                     tuple(injections), ca)
        return proxy, env

    def close(self, proxy: BatchProxy) -> EgressUsed:
        stats = self._get_hub().close(proxy)
        return EgressUsed(stats.record(), tuple(stats.blocks))

    def shutdown(self) -> None:
        with self._lock:
            hub, self._hub = self._hub, None
        if hub is not None:
            hub.shutdown()
