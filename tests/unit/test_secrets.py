"""The secrets file: plain values, injected ones (never in the environment a
sandbox gets), and one-line errors for what is malformed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tenantq.egress.policy import Rule
from tenantq.errors import InvalidInput
from tenantq.secrets import FileSecrets, InjectedSecret


def _file(tmp_path: Path, data: object, name: str = "secrets.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else str(data))
    return path


def test_plain_and_injected_secrets(tmp_path: Path) -> None:
    secrets = FileSecrets(_file(tmp_path, {"acme": {
        "PLAIN": "p-value",
        "STRIPE_KEY": {"value": "sk_live_xyz", "inject": {"host": "api.stripe.com", "header": "Authorization",
                                                        "format": "Bearer {value}"}},
    }}))
    assert secrets.for_tenant("acme") == {"PLAIN": "p-value"}, "an injected value never joins the env"
    assert secrets.injected("acme") == (InjectedSecret("STRIPE_KEY", "sk_live_xyz", Rule("api.stripe.com"),
                                                       "Authorization", "Bearer {value}"),)
    assert secrets.for_tenant("other") == {} and secrets.injected("other") == ()


def test_toml_works_too(tmp_path: Path) -> None:
    path = _file(tmp_path, '[acme]\nPLAIN = "v"\n[acme.KEY]\nvalue = "s-12345678"\n'
                 'inject = {host = "*.x.com:443", header = "X-Key"}\n',
                 "secrets.toml")
    secrets = FileSecrets(path)
    assert secrets.for_tenant("acme") == {"PLAIN": "v"}
    assert secrets.injected("acme")[0].rule == Rule("*.x.com", 443)


@pytest.mark.parametrize(("entry", "message"), [
    ({"value": "v"}, "an injected secret is"),
    ({"value": "v", "inject": {"host": "bad host", "header": "X"}}, "not a host name"),
    ({"value": "v", "inject": {"host": "a.com", "header": "Bad Header:"}}, "inject.header must be"),
    ({"value": "v", "inject": {"host": "a.com"}}, "inject.header must be"),
    ({"value": "v", "inject": {"host": "a.com", "header": "X", "format": "Bearer"}},
     "inject.format must contain"),
    ({"value": "v\r\nX-Evil: 1", "inject": {"host": "a.com", "header": "X"}}, "cannot contain line breaks"),
    ({"value": "short", "inject": {"host": "a.com", "header": "X"}}, "8 to 4096 printable ASCII"),
    ({"value": "with a space", "inject": {"host": "a.com", "header": "X"}}, "8 to 4096 printable ASCII"),
    ({"value": "naïve-value", "inject": {"host": "a.com", "header": "X"}}, "8 to 4096 printable ASCII"),
    (42, "the value must be a string"),
])
def test_malformed_entries_are_refused_with_one_line(tmp_path: Path, entry: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message) as err:
        FileSecrets(_file(tmp_path, {"acme": {"KEY": entry}}))
    assert "\n" not in str(err.value)
