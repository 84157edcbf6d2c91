"""Egress for Sandbox API sandboxes: `Sandbox.create(egress=["api.example.com",
"*.example.org:443"])`.

The same way out as a queue batch's (dispatch/executors/egress.py, docs/egress.md): the
sandbox has no network; the host listens on a Unix socket in the sandbox's
host-only egress dir (bound read-only into it, so only that sandbox can
connect), the agent forwards the sandbox's loopback to it and sets
HTTP(S)_PROXY for every later command, and the proxy admits only the rules'
hosts at global unicast addresses (rule E1) and counts the bytes. The proxy
runs in the process that made the sandbox (one event loop thread for all of
them); it goes with `delete()`, or with that process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from tenantq.egress.policy import EgressPolicy, Rule, parse_rules
from tenantq.egress.proxy import AddressGuard, BatchProxy, EgressHub
from tenantq.egress.tls import upstream_context
from tenantq.errors import InvalidInput
from tenantq.observe import metrics
from tenantq.sandbox.hostside import HostSandbox

SOCKET_NAME = "proxy.sock"
# one hub (event loop thread) per egress configuration (the settings are
# read at each create)
_hubs: dict[object, EgressHub] = {}
_lock = threading.Lock()


def rules(value: str | Iterable[str] | None) -> tuple[Rule, ...]:
    """The egress rules of a create (one-line InvalidInput for a bad one)."""
    if value is None:
        return ()
    if not isinstance(value, str) and not all(isinstance(r, str) for r in value):
        raise InvalidInput("egress must be a list of host rules such as "
                           "['api.example.com', '*.example.org:443']")
    return parse_rules(value)


def _get_hub(config: object | None = None) -> EgressHub:
    from tenantq.egress.config import EgressConfig

    config = config or EgressConfig.from_settings()
    assert isinstance(config, EgressConfig)
    with _lock:
        if config not in _hubs:
            _hubs[config] = EgressHub(AddressGuard(config.allow_networks),
                                      upstream_context(config.upstream_ca), config.max_names_per_batch)
        return _hubs[config]


def open_proxy(host: HostSandbox, tenant: str | None,
               allowed: tuple[Rule, ...]) -> tuple[BatchProxy, EgressHub]:
    label = tenant or "sandbox-api"

    def on_event(outcome: str, detail: str, amount: int) -> None:
        if outcome == "bytes":
            metrics.EGRESS_BYTES.labels(label, detail).inc(amount)
        else:
            metrics.EGRESS_REQUESTS.labels(label, outcome).inc(amount)

    hub = _get_hub()
    return hub.open(host.egress_dir / SOCKET_NAME, EgressPolicy(label, allowed), lambda: (None, None),
                    on_event), hub
