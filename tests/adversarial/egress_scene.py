"""The stage of tests/adversarial/test_egress_injection.py: three recording
upstreams on 127.0.0.1 (the secret's host `localhost:P` over TLS, another
allowed host `127.0.0.1:P2` over TLS, a plain-HTTP host `localhost:PP`), the
hostile tenant's secret `KEY` injected into `Authorization: Bearer {value}`
for `localhost:P` only, the worker told about the test CA and allowed
127.0.0.1/32; and the judging of what every attack left behind.

What is judged (docs/security.md rule E2, docs/egress.md "Host-side
credentials"): the value reaches no job result, error or worker log, in any
letter case or percent-encoding; no upstream ever receives the placeholder;
the secret's upstream receives the value only as one `Authorization: Bearer
<value>` line; each attack ends as its expectation says, with an egress block
row naming the secret attributed to its job."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.adversarial.checks import MALLORY
from tests.adversarial.egress_leaks import normal_forms, placeholder_seen, value_leaks
from tests.adversarial.egress_upstream import Upstream, UpstreamCA
from tests.adversarial.harness import Arena

SECRET_NAME = "KEY"
# the head is refused (403), nothing of it sent; the body is cut before the
# placeholder; the response is cut before the value; an ordinary request works;
# "safe": any outcome, as long as nothing leaks (no block owed)
EXPECTATIONS = ("head", "body", "response", "ok", "safe")


@dataclass
class Attack:
    name: str
    expect: str
    payload: dict[str, Any]
    kind: str = "egx.raw"
    job_id: int = 0
    # an encoding the proxy cannot read: not one byte of the body may pass
    opaque: bool = False


@dataclass
class Scene:
    arena: Arena
    value: str
    ca: UpstreamCA
    inject: Upstream
    other: Upstream
    plain: Upstream
    attacks: list[Attack] = field(default_factory=list)

    @classmethod
    def build(cls, arena: Arena, tmp_path: Path) -> Scene:
        ca = UpstreamCA(tmp_path / "upstream-ca", ("localhost", "127.0.0.1", "*.flood.test"))
        value = f"sk/TqAdv+{secrets.token_hex(12)}Zz="
        scene = cls(arena, value, ca, Upstream("inject", ca.server_context()),
                    Upstream("other", ca.server_context()), Upstream("plain"))
        data = json.loads(arena.secrets_file.read_text())
        data[MALLORY][SECRET_NAME] = {"value": value, "inject": {
            "host": scene.inject_host, "header": "Authorization", "format": "Bearer {value}"}}
        arena.secrets_file.write_text(json.dumps(data))
        arena.env.update({"TENANTQ_EGRESS_ALLOW_NETWORKS": "127.0.0.1/32",
                          "TENANTQ_EGRESS_UPSTREAM_CA": str(ca.ca_path)})
        arena.queue.set_tenant(MALLORY, egress=f"{scene.inject_host},{scene.other_host},{scene.plain_host}")
        return scene

    @property
    def inject_host(self) -> str:
        return f"localhost:{self.inject.port}"

    @property
    def other_host(self) -> str:
        return f"127.0.0.1:{self.other.port}"

    @property
    def plain_host(self) -> str:
        return f"localhost:{self.plain.port}"

    def stop(self) -> None:
        for upstream in (self.inject, self.other, self.plain):
            upstream.stop()

    # -- requests -----------------------------------------------------------------
    def head(self, tag: str, *, path: str = "/m/digest/t", method: str = "GET", host: str | None = None,
             auth: str | None = "Authorization: Bearer {PH}", extra: tuple[str, ...] = (),
             close: bool = True) -> list[str]:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host or self.inject_host}", f"X-Tqadv-Tag: {tag}"]
        lines += [auth] if auth else []
        lines += list(extra)
        return lines + (["Connection: close"] if close else [])

    def tunnel(self, name: str, expect: str, *, to: str = "inject", opaque: bool = False,
               **fields: Any) -> Attack:
        """An attack over a tunnel the proxy intercepts (CONNECT, then TLS)."""
        target = {"inject": self.inject_host, "other": self.other_host}[to]
        head_fields = {k: fields.pop(k) for k in ("path", "method", "auth", "extra", "close", "host")
                       if k in fields}
        if to == "other":
            head_fields.setdefault("host", self.other_host)
        payload = {"tag": name, "connect": target, "head": self.head(name, **head_fields), **fields}
        return self.add(Attack(name, expect, payload, opaque=opaque))

    def clear(self, name: str, expect: str, url_host: str, path: str = "/m/digest/t",
              **fields: Any) -> Attack:
        """A plain-HTTP request with an absolute URI, straight to the proxy."""
        head_fields = {k: fields.pop(k) for k in ("method", "auth", "extra") if k in fields}
        head = self.head(name, path=f"http://{url_host}{path}", host=url_host, **head_fields)
        return self.add(Attack(name, expect, {"tag": name, "head": head, **fields}))

    def add(self, attack: Attack) -> Attack:
        assert attack.expect in EXPECTATIONS, attack.expect
        self.attacks.append(attack)
        return attack

    def enqueue(self) -> None:
        ids = self.arena.attack_batch(*[(a.kind, a.payload) for a in self.attacks])
        for attack, job_id in zip(self.attacks, ids, strict=True):
            attack.job_id = job_id

    # -- judging --------------------------------------------------------------------
    def judge(self) -> None:
        p = self.arena.problems
        for attack in self.attacks:
            p += [f"{attack.name} (job {attack.job_id}): {m}" for m in self.judge_attack(attack)]
        for i, run in enumerate(self.arena.runs):
            for why in value_leaks(run.log.encode("latin-1", "replace"), self.value):
                p.append(f"rule E2: the worker log {i + 1} holds {why} of the injected secret")
        p += self.judge_upstreams()

    def judge_attack(self, attack: Attack) -> list[str]:
        info = self.arena.job(attack.job_id)
        out: list[str] = []
        result = info.result if isinstance(info.result, dict) else {}
        text = (json.dumps(info.result) + (info.last_error or "")).encode("latin-1", "replace")
        raw = base64.b64decode(result.get("raw_b64", "") or "")
        for why in sorted(set(value_leaks(text, self.value) + value_leaks(raw, self.value))):
            out.append(f"rule E2: {why} of the injected secret reached the sandbox "
                       f"(job result {str(result.get('status'))[:80]!r})")
        blocks = list(getattr(info, "egress_blocked", []) or [])
        if value_leaks(json.dumps(blocks).encode(), self.value):
            out.append(f"an egress block row holds the secret's value: {blocks}")
        named = [b for b in blocks if SECRET_NAME in str(b.get("reason", ""))]
        status = str(result.get("status", ""))
        tag_upstream = any(u.bytes_with_tag(attack.name) for u in (self.inject, self.other, self.plain))
        if info.status != "done":
            return [*out, f"the attack job is {info.status}: {(info.last_error or '')[:200]}"]
        if result.get("error") and attack.expect != "safe":
            out.append(f"the attack never reached the proxy's checks (the client failed first: "
                       f"{str(result['error'])[:160]}; CONNECT {result.get('connect')!r})")
        if attack.expect == "head":
            if not status.startswith("HTTP/1.1 403"):
                out.append(f"the placeholder out of place in the head was not refused with 403: "
                           f"got {status[:120]!r} (CONNECT {result.get('connect')!r})")
            if tag_upstream:
                out.append("a request head refused for the placeholder was sent upstream (its tag arrived)")
        if attack.expect in ("head", "body") and not named:
            out.append(f"no egress block row naming secret {SECRET_NAME} for this job: {blocks}")
        if attack.expect == "body" and status.startswith(("HTTP/1.1 200", "HTTP/1.0 200")):
            out.append(f"the request with the placeholder in its body was answered by the upstream: "
                       f"{status[:120]!r}")
        if attack.expect == "response":
            # the value found: a block naming the secret; an encoding it cannot read: one naming that
            if not blocks:
                out.append("the response held the value (or a body the proxy cannot read) but the job has "
                           "no egress block row")
            body = raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else b""
            if attack.opaque and body:
                out.append(f"a body in an encoding the proxy cannot read reached the sandbox: "
                           f"{len(body)} bytes (docs: cut before its first byte)")
        if attack.expect == "ok":
            out += self.judge_ok(result)
        return out

    def judge_ok(self, result: dict[str, Any]) -> list[str]:
        body = result.get("body")
        if body is None and result.get("raw_b64"):
            raw = base64.b64decode(result["raw_b64"])
            body = raw.split(b"\r\n\r\n", 1)[-1].decode("latin-1")
        status = result.get("status")
        if status not in (200, "HTTP/1.1 200 OK") or not body:
            return [f"an ordinary request (placeholder only in Authorization: Bearer) failed: {status!r} "
                    f"{str(result.get('error'))[:200]}"]
        try:
            seen = json.loads(body)
        except ValueError:
            return [f"the ordinary request got a body that is not the upstream's digest: {body[:200]!r}"]
        want = hashlib.sha256(f"Bearer {self.value}".encode()).hexdigest()
        if seen.get("auth_count") != 1 or seen.get("auth_sha256") != want:
            return [f"the upstream did not receive exactly one 'Authorization: Bearer <value>' "
                    f"({seen.get('auth_count')} Authorization header(s), digest match: "
                    f"{seen.get('auth_sha256') == want})"]
        return []

    def judge_upstreams(self) -> list[str]:
        out: list[str] = []
        for upstream in (self.inject, self.other, self.plain):
            for i, conn in enumerate(upstream.connections):
                if placeholder_seen(bytes(conn.raw)):
                    first = bytes(conn.raw).split(b"\r\n")[0][:100]
                    out.append(f"rule E2: upstream {upstream.name} received the placeholder "
                               f"(connection {i}, starting {first!r})")
            if upstream is self.inject:
                continue
            for i, conn in enumerate(upstream.connections):
                if self.value.lower() in normal_forms(bytes(conn.raw)):
                    out.append(f"rule E2: upstream {upstream.name}, not the secret's host, received the "
                               f"value (connection {i}, tls={conn.tls})")
        want = f"authorization: bearer {self.value}".lower()
        for req in self.inject.requests:
            lines = [ln for ln in req.lines() if self.value.lower() in normal_forms(ln.encode("latin-1"))]
            if len(lines) > 1 or (lines and lines[0].lower() != want):
                out.append(f"rule E2: the secret's host got the value outside one 'Authorization: Bearer' "
                           f"line (request tag {req.tag}): {len(lines)} line(s) hold it")
            if self.value.lower() in normal_forms(req.body_raw):
                out.append(f"rule E2: the secret's host got the value in a body (request tag {req.tag})")
            if (req.tag or "").endswith("-second") and lines:
                out.append(f"docs/egress.md (one request per connection): a second request on an "
                           f"intercepted connection reached upstream with the secret injected ({req.tag})")
            if not self.inject.connections[req.conn].tls:
                out.append(f"rule E2: the secret's host got a request in clear text (tag {req.tag})")
        return out
