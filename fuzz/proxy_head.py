"""Fuzz target: the egress proxy's parsing of a request head from the guest
(egress/proxy.py: the request line, host normalisation, the policy match,
the address guard), with the same rules the proxy applies to a real head.

Any head a guest sends must end in a parsed target or a refusal: never an
exception."""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from tenantq.egress import proxy
    from tenantq.egress.policy import EgressPolicy, parse_rules

POLICY = EgressPolicy("fuzz", parse_rules("api.example.com,*.example.org:443,203.0.113.7"))
GUARD = proxy.AddressGuard(("127.0.0.1/32",))


def test_one_input(data: bytes) -> None:
    head = data[:16384]
    lines = head.decode("latin-1").split("\r\n")
    target = proxy._parse_target(lines[0].split(" "))
    if target is not None:
        method, host, port, path = target
        POLICY.allows(host, port)
        proxy._origin_form(method, path, lines[1:])
    GUARD.refusal(head.decode("latin-1", "replace")[:64])


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
