"""Judging what the egress attacks got back (tests/adversarial/test_egress_*.py):
a response as an attacker can read it (as it is, de-chunked, decompressed,
percent-decoded, in any letter case) and whether it holds an injected
secret's value, or a byte of it, or a placeholder."""

from __future__ import annotations

import contextlib
import urllib.parse
import zlib

PLACEHOLDER_PREFIX = "tenantq-placeholder-"


def dechunk(data: bytes) -> bytes:
    """As much of a chunked body as is there (tolerant of a cut)."""
    out, rest = b"", data
    while rest:
        line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            break
        try:
            size = int(line.split(b";")[0].strip(), 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2:]
    return out


def inflate(data: bytes) -> list[bytes]:
    """Every way the bytes decompress (gzip, zlib, raw deflate), as far as they go."""
    out = []
    for wbits in (47, -15):
        with contextlib.suppress(zlib.error):
            d = zlib.decompressobj(wbits=wbits)
            got = d.decompress(data)
            if got:
                out.append(got)
    return out


def views(raw: bytes) -> list[bytes]:
    """What an attacker can make of the bytes it got: as they are, the body
    de-chunked, decompressed (twice), and every response head."""
    found, at = [raw], raw.find(b"\r\n\r\n")
    for _ in range(8):  # after each end of a head (a 1xx response has one of its own)
        if at < 0:
            break
        part = raw[at + 4:]
        found += [part, dechunk(part)]
        at = raw.find(b"\r\n\r\n", at + 4)
    for _ in range(2):
        found += [x for v in list(found) for x in inflate(v)]
    return found


def normal_forms(data: bytes) -> str:
    """Lower-cased, and percent-decoded once and twice."""
    text = data.decode("latin-1")
    once = urllib.parse.unquote(text, encoding="latin-1")
    return "\n".join((text, once, urllib.parse.unquote(once, encoding="latin-1"))).lower()


def value_leaks(data: bytes, value: str) -> list[str]:
    """Why `data` carries the value (or a byte of it after its header's prefix)."""
    problems = []
    for view in views(data):
        text = normal_forms(view)
        if value.lower() in text:
            problems.append("the whole value")
        elif value.lower()[:8] in text or f"bearer {value.lower()[0]}" in text:
            problems.append("a part of the value (the response was not cut before it)")
    return sorted(set(problems))


def placeholder_seen(data: bytes) -> bool:
    return any(PLACEHOLDER_PREFIX[:10] in normal_forms(v) for v in [data, dechunk(data)])
