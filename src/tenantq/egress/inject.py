"""Host-side credential injection (docs/security.md, rule E2): what the egress
proxy does to the request heads of a tenant with injected secrets, and what
it looks for in the streams around them (stream_guard.py).

The value is written in one place only: the secret's header, on a request
over TLS to a host its rule matches. A placeholder anywhere else (the
request line, another header, the body; in any letter case, percent-encoded;
to another host; over plain HTTP) refuses the request: the placeholder is a
tripwire, never substituted.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenantq.egress.policy import Rule
from tenantq.egress.stream_guard import StreamGuard, views

# hop-by-hop and framing headers the proxy decides on an injected request
REPLACED = ("connection", "keep-alive", "proxy-connection", "accept-encoding")


@dataclass(frozen=True)
class Injection:
    """A secret the sandbox sees only as `placeholder`: the proxy sets
    `header` to `template` with `value` on HTTPS requests to hosts matching
    `rule`; a request carrying the placeholder anywhere else is refused."""

    name: str
    value: str
    placeholder: str
    rule: Rule
    header: str
    template: str = "{value}"


def placeholder_in(injections: tuple[Injection, ...], data: bytes) -> Injection | None:
    """The injection whose placeholder `data` carries (any case, percent-encoded)."""
    shown = views(data)
    for inj in injections:
        needle = inj.placeholder.lower().encode()
        if any(needle in view for view in shown):
            return inj
    return None


def smuggled(injections: tuple[Injection, ...], data: bytes, host: str, port: int, *,
             tls: bool) -> str | None:
    """Why `data` (a request head going to host:port, none of it replaced)
    must not pass: it carries a placeholder."""
    inj = placeholder_in(injections, data)
    if inj is None:
        return None
    if not inj.rule.matches(host, port):
        return f"the placeholder of secret {inj.name} may only go to {inj.rule}, not {host}:{port}"
    if not tls:
        return f"secret {inj.name} is injected over HTTPS only"
    return f"the placeholder of secret {inj.name} may only be sent in its {inj.header} header"


def _lines(head: bytes) -> tuple[str, list[str]] | str:
    text = head.decode("latin-1")
    if not text.endswith("\r\n\r\n"):
        return "a malformed request head"
    lines = text[:-4].split("\r\n")
    for line in lines[1:]:
        # obs-fold (a line continuing the previous header) and lines without a
        # name would let a placeholder ride along a header that is replaced
        if not line or line[0] in " \t" or ":" not in line or any(c in line for c in "\0\r\n"):
            return "a malformed request head"
    return lines[0], lines[1:]


def _name(header: str) -> str:
    return header.split(":", 1)[0].strip().lower()


def inject_head(injections: tuple[Injection, ...], head: bytes, host: str, port: int) -> bytes | str:
    """The request head to send upstream (over TLS) with the secrets for
    this host in their headers, asking for an identity response on a
    connection used once; or the reason it is refused."""
    parsed = _lines(head)
    if isinstance(parsed, str):
        return parsed
    request, headers = parsed
    here = [inj for inj in injections if inj.rule.matches(host, port)]
    replaced = {inj.header.lower() for inj in here}
    # the secret's own header is replaced whole: a placeholder there is how
    # clients are written (`Authorization: Bearer $KEY`); anywhere else it is refused
    kept = [h for h in headers if _name(h) not in replaced]
    rest = "\r\n".join([request, *kept]).encode("latin-1")
    reason = smuggled(injections, rest, host, port, tls=True)
    if reason is not None:
        return reason
    kept = [h for h in kept if _name(h) not in REPLACED]
    added = [f"{inj.header}: {inj.template.format(value=inj.value)}" for inj in here]
    extra = ["Accept-Encoding: identity"] if here else []
    out = "\r\n".join([request, *kept, *added, *extra, "Connection: close"]) + "\r\n\r\n"
    return out.encode("latin-1")


def request_guard(injections: tuple[Injection, ...], head: bytes) -> StreamGuard:
    """What follows a request head on its way upstream: its body, checked
    for every placeholder (and anything after it, as sent)."""
    needles = {inj.placeholder.encode(): f"the placeholder of secret {inj.name} in the request body"
               for inj in injections}
    return StreamGuard(needles, response=False, request_head=head, what="the request")


def response_guard(injections: tuple[Injection, ...], host: str, port: int) -> StreamGuard | None:
    """The response to a request injected into, checked for the values
    written into it (None when nothing was injected for this host)."""
    here = [inj for inj in injections if inj.rule.matches(host, port)]
    if not here:
        return None
    needles = {inj.value.encode(): f"the response of {host}:{port} held the value of secret {inj.name}"
               for inj in here}
    return StreamGuard(needles, response=True, what=f"the response of {host}:{port}")
