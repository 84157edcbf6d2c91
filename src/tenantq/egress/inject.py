"""Host-side credential injection: what the egress proxy does to a request
head of a tenant with injected secrets (after terminating its TLS with the
tenant's CA, tls.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tenantq.egress.policy import Rule


@dataclass(frozen=True)
class Injection:
    """A secret the sandbox sees only as `placeholder`: the proxy puts `value`
    in its place (and, with `header`, sets that header) on HTTPS requests to
    hosts matching `rule`; a request carrying the placeholder anywhere else
    is blocked."""

    name: str
    value: str
    placeholder: str
    rule: Rule
    header: str | None = None
    template: str = "{value}"


def smuggled(injections: tuple[Injection, ...], data: bytes, host: str, port: int, *,
             tls: bool) -> str | None:
    """Why `data` (going to host:port) must not pass: it carries a placeholder
    to a host its secret is not for, or in clear text."""
    for inj in injections:
        if inj.placeholder.encode() in data:
            if not inj.rule.matches(host, port):
                return (f"the placeholder of secret {inj.name} may only go to {inj.rule}, "
                        f"not {host}:{port}")
            if not tls:
                return f"secret {inj.name} is injected over HTTPS only"
    return None


def inject_head(injections: tuple[Injection, ...], head: bytes, host: str, port: int) -> bytes | str:
    """The request head with placeholders swapped for values (and injected
    headers set), forced to one request per connection; or the reason it is
    refused."""
    reason = smuggled(injections, head, host, port, tls=True)
    if reason is not None:
        return reason
    lines = head.decode("latin-1").split("\r\n")
    request, headers = lines[0], [h for h in lines[1:] if h]
    for inj in injections:
        if not inj.rule.matches(host, port):
            continue
        headers = [h.replace(inj.placeholder, inj.value) for h in headers]
        request = request.replace(inj.placeholder, inj.value)
        if inj.header:
            name = inj.header.lower()
            headers = [h for h in headers if h.split(":", 1)[0].strip().lower() != name]
            headers.append(f"{inj.header}: {inj.template.format(value=inj.value)}")
    # one request per connection: what follows on it is never looked at
    headers = [h for h in headers if h.split(":", 1)[0].strip().lower() != "connection"]
    return ("\r\n".join([request, *headers, "Connection: close"]) + "\r\n\r\n").encode("latin-1")
