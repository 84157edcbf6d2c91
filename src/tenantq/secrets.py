"""Scoped secrets: each tenant's values reach only that tenant's sandboxes.

`tenantq worker --secrets FILE` reads a JSON or TOML mapping of tenant ->
{NAME: value}. The values travel to the guest runner over its stdin and live
only in its process environment; they are never written to disk outside the
sandbox, and never into the dispatcher's own environment. Vault-style
providers implement the same one-method protocol.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from tenantq.errors import InvalidInput
from tenantq.store import validation

SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


class SecretsProvider(Protocol):
    def for_tenant(self, tenant: str) -> Mapping[str, str]: ...


class NoSecrets:
    def for_tenant(self, tenant: str) -> Mapping[str, str]:
        return {}


class FileSecrets:
    """Secrets from a JSON or TOML file, read once at start-up."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._by_tenant = parse_secrets(path)

    def for_tenant(self, tenant: str) -> Mapping[str, str]:
        return dict(self._by_tenant.get(tenant, {}))

    def tenants(self) -> list[str]:
        return sorted(self._by_tenant)


def parse_secrets(path: Path) -> dict[str, dict[str, str]]:
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
    for tenant, values in data.items():
        validation.tenant_id(tenant)
        if not isinstance(values, dict):
            raise InvalidInput(f"secrets for tenant {tenant!r} must be a mapping of NAME -> value")
        for name, value in values.items():
            if not SECRET_NAME.match(name) or not isinstance(value, str):
                raise InvalidInput(
                    f"secret {name!r} of tenant {tenant!r}: names are identifiers, values strings")
        out[tenant] = dict(values)
    return out
