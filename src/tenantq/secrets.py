"""Scoped secrets: each tenant's values reach only that tenant's sandboxes.

`tenantq worker --secrets FILE` reads a JSON or TOML mapping of tenant ->
{NAME: value}. The values travel to the guest runner over its stdin and live
only in its process environment; they are never written to disk outside the
sandbox, and never into the dispatcher's own environment. Vault-style
providers implement the same protocol.

A value may instead be injected by the host, never entering the sandbox:

    {"acme": {"STRIPE_KEY": {"value": "sk_live_...",
                             "inject": {"host": "api.stripe.com",
                                        "header": "Authorization", "format": "Bearer {value}"}}}}

The sandbox's STRIPE_KEY is then a per-batch placeholder; the batch's egress
proxy sets `header` to `format` with the value on HTTPS requests to hosts
matching `host` (an egress rule), refuses any request that carries the
placeholder anywhere else, and cuts a response that holds the value
(docs/security.md, rule E2). `header` is required; the value is 8 to 4,096
printable ASCII characters (the proxy looks for it in responses: a shorter
one would be found by chance).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tenantq.domain import validation
from tenantq.egress.policy import Rule, parse_rule
from tenantq.errors import InvalidInput

SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")


@dataclass(frozen=True)
class InjectedSecret:
    name: str
    value: str
    rule: Rule
    header: str
    template: str = "{value}"


class SecretsProvider(Protocol):
    def for_tenant(self, tenant: str) -> Mapping[str, str]:
        """The tenant's secrets that go into its sandboxes' environment.
        Injected ones are never among them: the sandbox executor adds their
        placeholders and gives the values only to the egress proxy."""
        ...

    def injected(self, tenant: str) -> tuple[InjectedSecret, ...]: ...


class NoSecrets:
    def for_tenant(self, tenant: str) -> Mapping[str, str]:
        return {}

    def injected(self, tenant: str) -> tuple[InjectedSecret, ...]:
        return ()


class FileSecrets:
    """Secrets from a JSON or TOML file, read once at start-up."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._by_tenant, self._injected = parse_secrets(path)

    def for_tenant(self, tenant: str) -> Mapping[str, str]:
        return dict(self._by_tenant.get(tenant, {}))

    def injected(self, tenant: str) -> tuple[InjectedSecret, ...]:
        return self._injected.get(tenant, ())

    def tenants(self) -> list[str]:
        return sorted(self._by_tenant)


def parse_secrets(path: Path) -> tuple[dict[str, dict[str, str]], dict[str, tuple[InjectedSecret, ...]]]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read secrets file {path}: {exc.strerror}") from None
    data: Any
    try:
        data = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise InvalidInput(f"secrets file {path} is not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"secrets file {path} must map tenant -> {{NAME: value}}")
    out: dict[str, dict[str, str]] = {}
    injected: dict[str, tuple[InjectedSecret, ...]] = {}
    for tenant, values in data.items():
        validation.tenant_id(tenant)
        if not isinstance(values, dict):
            raise InvalidInput(f"secrets for tenant {tenant!r} must be a mapping of NAME -> value")
        plain: dict[str, str] = {}
        hosted: list[InjectedSecret] = []
        for name, value in values.items():
            where = f"secret {name!r} of tenant {tenant!r}"
            if not SECRET_NAME.match(name):
                raise InvalidInput(f"{where}: names are identifiers")
            if isinstance(value, dict):
                hosted.append(_injected(name, value, where))
            elif isinstance(value, str):
                plain[name] = value
            else:
                raise InvalidInput(f"{where}: the value must be a string or {{value, inject}}")
        out[tenant] = plain
        injected[tenant] = tuple(hosted)
    return out, injected


def _injected(name: str, spec: dict[str, Any], where: str) -> InjectedSecret:
    value, inject = spec.get("value"), spec.get("inject")
    if not isinstance(value, str) or not isinstance(inject, dict) or not isinstance(inject.get("host"), str):
        raise InvalidInput(f"{where}: an injected secret is "
                           "{value: str, inject: {host: rule, header: name, format?}}")
    rule = parse_rule(inject["host"])
    header, template = inject.get("header"), inject.get("format", "{value}")
    if not isinstance(header, str) or not HEADER_NAME.match(header):
        raise InvalidInput(f"{where}: inject.header must be an HTTP header name (the only place the value "
                           "is written)")
    if not isinstance(template, str) or "{value}" not in template:
        raise InvalidInput(f"{where}: inject.format must contain {{value}}")
    if any(c in value + template for c in "\r\n\0"):
        raise InvalidInput(f"{where}: an injected value cannot contain line breaks")
    if not 8 <= len(value) <= 4096 or not all(" " < c < "\x7f" for c in value) \
            or not all(" " <= c < "\x7f" for c in template):
        raise InvalidInput(f"{where}: an injected value is 8 to 4096 printable ASCII characters without "
                           "spaces, and its format printable ASCII")
    return InjectedSecret(name, value, rule, header, template)
