"""Rule E3 of docs/security.md, measured: one tenant's job that CONNECTs to
thousands of distinct host names through a wildcard rule (its tenant has an
injected secret, so every CONNECT is TLS-intercepted with the tenant's CA)
costs the dispatcher a bounded amount of memory, writes nothing under
`<data_dir>/egress-ca/`, and slows a neighbour tenant's requests little.

Set-up (every process and the namespace end with the bench):
- wildcard DNS: dnsmasq (Debian's dnsmasq-base, installed when missing)
  answers `*.flood.test` with 127.0.0.1 on port 53 of a loopback address;
  the dispatcher runs in a private mount namespace (`unshare --mount`) where
  /etc/resolv.conf names that server and /etc/nsswitch.conf says
  `hosts: files dns`, so the proxy's getaddrinfo finds every name there and
  the machine's own files are never changed;
- upstream: a TLS server on 127.0.0.1 with a `*.flood.test` certificate from
  a test CA, trusted by the proxy through TENANTQ_EGRESS_UPSTREAM_CA
  (TENANTQ_EGRESS_ALLOW_NETWORKS=127.0.0.1/32 lets it connect to loopback);
- the dispatcher: a process holding the egress proxies exactly as the
  sandbox executor makes them (`EgressProxies`), with mallory's batch (rule
  `*.flood.test:PORT`, an injected secret) and acme's (one name, an injected
  secret too) open;
- mallory's job: a client process CONNECTing to `n<i>.flood.test`, TLS
  trusting only mallory's CA, one GET each, `rate` new names a second (0: as
  fast as `concurrency` allows) until `names` names or `seconds`;
- acme, the neighbour: one HTTPS request (a new connection) through its own
  proxy every `interval` seconds, first alone (the baseline), then during
  the flood and after it.

Measured: the dispatcher's VmRSS/VmHWM (sampled from /proc), the files
created or written under egress-ca/ (inotify, so a file written and removed
counts too), acme's p50/p99 per phase, and mallory's names by outcome. The
bounds: peak VmRSS <= idle + 50 MiB, no file written, acme's p50 during the
flood <= 1.5x its baseline.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import tenantq
from bench.common import machine_info, save, scratch_schema
from bench.egress_flood_support import (
    DOMAIN,
    Child,
    DirWatch,
    dns_answer,
    dnsmasq_argv,
    ensure_dnsmasq,
    files_under,
    free_dns_address,
    make_certs,
    namespace_argv,
)

console = Console(width=150)
MODULE = [sys.executable, "-m", "bench.egress_flood_support"]
NEIGHBOUR_HOST = f"acme-api.{DOMAIN}"
CA_FILES = {"ca.key", "ca.pem"}  # a tenant CA's own files, made when its first batch opens
HELP = {
    "names": "distinct host names mallory's job tries at most",
    "seconds": "the flood's length at most (names in flight then are finished)",
    "rate": "new names per second (0: as fast as --concurrency allows)",
    "concurrency": "mallory's connections in flight at most (the proxy cuts past 256 streams)",
    "baseline_seconds": "acme alone before the flood (its first quarter, at most 2 s, is warm-up)",
    "after_seconds": "acme after the flood",
    "interval": "seconds between the starts of acme's requests",
    "batch_seconds": "a new batch (a new proxy) for mallory every S seconds (0: one batch)",
    "rss_bound_mib": "the bound on the dispatcher's VmRSS above idle",
    "p50_factor": "the bound on acme's p50 during the flood, as a multiple of its baseline",
}


def _psi() -> tuple[float, int] | None:
    """(now, µs some task waited for a CPU, since boot): the machine's CPU
    pressure, to tell a busy machine from a slow proxy."""
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return time.monotonic(), int(some.rsplit("total=", 1)[1])


def _pressure(a: tuple[float, int] | None, b: tuple[float, int] | None) -> float | None:
    """The share of the time between two _psi() readings that a task waited for a CPU."""
    return (b[1] - a[1]) / 1e6 / (b[0] - a[0]) if a and b and b[0] > a[0] else None


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


class RssSampler:
    """VmRSS, VmHWM, open descriptors and CPU time of one process, every `every` s."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int, int, int]] = []  # (t, rss KiB, hwm KiB, fds)
        self.cpu: list[tuple[float, float]] = []  # (t, user + system seconds)
        self._tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def sample(self) -> tuple[float, int, int, int] | None:
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{self.pid}/fd"))
            stat = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        self.cpu.append((time.monotonic(), (int(stat[11]) + int(stat[12])) / self._tick))
        fields = {k: v.split()[0] for k, _, v in (line.partition(":") for line in status.splitlines())
                  if v.strip()}
        row = (time.monotonic(), int(fields["VmRSS"]), int(fields["VmHWM"]), fds)
        self.samples.append(row)
        return row

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def between(self, start: float, end: float) -> list[int]:
        return [rss for t, rss, _, _ in self.samples if start <= t <= end]

    def cpu_share(self, start: float, end: float) -> float | None:
        """CPU seconds per second between two times (1.0: one core busy)."""
        inside = [(t, c) for t, c in self.cpu if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


class Neighbour:
    """acme's job: an HTTPS request through its proxy every `interval` s."""

    def __init__(self, sock: str, ca: str, port: int, interval: float) -> None:
        self.sock, self.port, self.interval = sock, port, interval
        self.ctx = ssl.create_default_context(cafile=ca)
        self.samples: list[tuple[float, float, str | None]] = []  # (start, seconds, error)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            error = self.once()
            self.samples.append((t0, time.monotonic() - t0, error))
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def once(self) -> str | None:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                raw.settimeout(30)
                raw.connect(self.sock)
                raw.sendall(f"CONNECT {NEIGHBOUR_HOST}:{self.port} HTTP/1.1\r\n"
                            f"Host: {NEIGHBOUR_HOST}:{self.port}\r\n\r\n".encode())
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = raw.recv(4096)
                    if not chunk:
                        return "closed before answering CONNECT"
                    head += chunk
                if not head.startswith(b"HTTP/1.1 200"):
                    return head.split(b"\r\n", 1)[0].decode("latin-1")[:200]
                with self.ctx.wrap_socket(raw, server_hostname=NEIGHBOUR_HOST) as tls:
                    tls.sendall(f"GET / HTTP/1.1\r\nHost: {NEIGHBOUR_HOST}\r\n"
                                "Connection: close\r\n\r\n".encode())
                    reply = b""
                    while not reply.endswith(b"\r\n\r\nok\n"):
                        chunk = tls.recv(4096)
                        if not chunk:
                            break
                        reply += chunk
            return None if reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok\n") else \
                f"upstream answered {reply[:60]!r}"
        except (OSError, ssl.SSLError) as exc:
            return f"{type(exc).__name__}: {exc}"[:200]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def between(self, start: float, end: float) -> tuple[list[float], int]:
        picked = [(s, e) for t, s, e in self.samples if start <= t < end]
        return [s for s, e in picked if e is None], sum(1 for _, e in picked if e is not None)


def run(*, names: int = 6_000, seconds: float = 90.0, rate: float = 100.0, concurrency: int = 64,
        baseline_seconds: float = 20.0, after_seconds: float = 5.0, interval: float = 0.05,
        batch_seconds: float = 0.0, rss_bound_mib: float = 50.0, p50_factor: float = 1.5) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise RuntimeError("egress-flood runs as root (a mount namespace for its DNS, a server on port 53)")
    settings = {"names": names, "seconds": seconds, "rate": rate, "concurrency": concurrency,
                "baseline_seconds": baseline_seconds, "after_seconds": after_seconds, "interval": interval,
                "batch_seconds": batch_seconds, "rss_bound_mib": rss_bound_mib, "p50_factor": p50_factor}
    dnsmasq = ensure_dnsmasq()
    tmp = Path(tempfile.mkdtemp(prefix="tenantq-bench-flood-"))
    load_before = os.getloadavg()
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        test_ca, upstream_cert = make_certs(tmp)
        dns = free_dns_address()
        dns_proc = Child("dnsmasq", dnsmasq_argv(dnsmasq, dns), tmp / "dnsmasq.err")
        stack.callback(dns_proc.stop)
        deadline = time.monotonic() + 10
        while dns_answer(dns, f"check.{DOMAIN}") != "127.0.0.1":
            if dns_proc.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dnsmasq on {dns}:53 does not answer: {dns_proc.stderr_tail(5)}")
            time.sleep(0.05)
        upstream = Child("upstream", [*MODULE, "upstream", json.dumps({"cert": str(upstream_cert)})],
                         tmp / "upstream.err")
        stack.callback(upstream.stop)
        port = int(upstream.event(60)["port"])
        resolv, nsswitch = tmp / "resolv.conf", tmp / "nsswitch.conf"
        resolv.write_text(f"nameserver {dns}\noptions timeout:2 attempts:2\n")
        nsswitch.write_text("hosts: files dns\n")
        data_dir = tmp / "data"
        data_dir.mkdir()
        inject = {"header": "Authorization", "format": "Bearer {value}"}
        (tmp / "secrets.json").write_text(json.dumps({
            "mallory": {"MALLORY_TOKEN": {"value": f"mallory-{secrets.token_hex(8)}",
                                          "inject": {"host": f"api.{DOMAIN}:{port}", **inject}}},
            "acme": {"ACME_TOKEN": {"value": f"acme-{secrets.token_hex(8)}",
                                    "inject": {"host": f"{NEIGHBOUR_HOST}:{port}", **inject}}}}))
        spec = {"port": port, "data_dir": str(data_dir), "work_dir": str(tmp / "sandboxes"),
                "secrets": str(tmp / "secrets.json"), "batch_seconds": batch_seconds,
                "check_names": [f"check.{DOMAIN}", NEIGHBOUR_HOST],
                "rules": {"mallory": [f"*.{DOMAIN}:{port}"], "acme": [f"{NEIGHBOUR_HOST}:{port}"]}}
        env = {**os.environ, "TENANTQ_EGRESS_ALLOW_NETWORKS": "127.0.0.1/32",
               "TENANTQ_EGRESS_UPSTREAM_CA": str(test_ca)}
        dispatcher = Child("dispatcher", namespace_argv(
            resolv, nsswitch if Path("/etc/nsswitch.conf").exists() else None,
            [*MODULE, "dispatcher", json.dumps(spec)]), tmp / "dispatcher.err", env)
        stack.callback(dispatcher.stop)
        ready = dispatcher.event(120)
        own_mounts = os.readlink(f"/proc/{ready['pid']}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        ca_dir = data_dir / "egress-ca"
        files_at_open = files_under(ca_dir)
        watch = DirWatch(data_dir)  # egress-ca/ too if it is made later
        stack.callback(watch.close)
        rss = RssSampler(int(ready["pid"]))
        stack.callback(rss.close)
        neighbour = Neighbour(ready["acme_socket"], ready["acme_ca"], port, interval)
        stack.callback(neighbour.close)
        opened = time.monotonic()
        psi = [_psi()]
        time.sleep(baseline_seconds)
        psi.append(_psi())
        flood = Child("flood", [*MODULE, "flood", json.dumps({
            "socket": ready["mallory_socket"], "ca": ready["mallory_ca"], "port": port, "names": names,
            "seconds": seconds, "rate": rate, "concurrency": concurrency, "prefix": "n", "domain": DOMAIN})],
            tmp / "flood.err")
        stack.callback(flood.stop)
        flood_start = float(flood.event(60)["t"])
        flooded = flood.event(seconds + 120)
        flood_end = float(flooded["end"])
        psi.append(_psi())
        time.sleep(after_seconds)
        neighbour.close()
        after_flood = time.monotonic()
        rss_after_flood = rss.sample()
        dispatcher.send("close mallory")
        dispatcher.event(30)
        time.sleep(1.0)
        rss_after_close = rss.sample()
        rss.close()
        dispatcher.send("quit")
        batches = dispatcher.event(60)["batches"]
        watch.close()
        files_at_end = files_under(ca_dir)
        stderr = {c.name: c.stderr_tail() for c in (dispatcher, flood, upstream, dns_proc)}
    load_after = os.getloadavg()

    # -- results -----------------------------------------------------------------------------------------
    warm = opened + min(2.0, baseline_seconds / 4)  # the first requests warm up imports and caches
    idle_rss = statistics.median(rss.between(flood_start - 2.0, flood_start)
                                 or rss.between(opened, flood_start))
    peak_rss = max(rss.between(flood_start, after_flood))
    hwm_end = rss.samples[-1][2]
    base, base_err = neighbour.between(warm, flood_start)
    during, during_err = neighbour.between(flood_start, flood_end)
    after, after_err = neighbour.between(flood_end, after_flood + 1)
    written = [(t, p) for t, p in watch.created
               if p.startswith("egress-ca/") and Path(p).name not in CA_FILES]
    created = [p for _, p in written]
    created_flood = [p for t, p in written if t >= flood_start]
    leaves = {p: s for p, s in files_at_end.items() if Path(p).name not in CA_FILES}
    outcomes: dict[str, int] = flooded["outcomes"]
    through = outcomes.get("ok", 0)
    refused = {k: v for k, v in outcomes.items() if k.startswith("refused")}
    errors = {k: v for k, v in outcomes.items() if k != "ok" and not k.startswith("refused")}
    p50_base, p50_during = statistics.median(base), statistics.median(during) if during else float("nan")
    checks = {
        "rss": peak_rss <= idle_rss + rss_bound_mib * 1024,
        "disk": not created and not leaves and not watch.overflowed,
        "neighbour_p50": bool(during) and p50_during <= p50_factor * p50_base,
        "neighbour_errors": base_err + during_err + after_err == 0,
    }

    table = Table(title=f"egress-flood: mallory CONNECTs to {flooded['attempted']:,} names through "
                        f"*.{DOMAIN} (intercepted) beside acme's requests (every {interval * 1000:.0f} ms)")
    for col in ("measure", "value", "bound", "verdict"):
        table.add_column(col, justify="left" if col in ("measure", "bound") else "right")

    def verdict(ok: bool) -> str:
        return "[green]PASS[/]" if ok else "[red]FAIL[/]"

    def mib(kib: float) -> str:
        return f"{kib / 1024:,.1f} MiB"

    table.add_row("dispatcher VmRSS idle (before the flood)", mib(idle_rss), "", "")
    table.add_row("dispatcher VmRSS peak (flood + after)", f"{mib(peak_rss)} (+{mib(peak_rss - idle_rss)})",
                  f"<= idle + {rss_bound_mib:g} MiB", verdict(checks["rss"]))
    if rss_after_flood and rss_after_close:
        table.add_row("  after the flood / after mallory's batch closed",
                      f"{mib(rss_after_flood[1])} / {mib(rss_after_close[1])}", "", "")
    table.add_row("  VmHWM at the end / most open fds", f"{mib(hwm_end)} / {max(s[3] for s in rss.samples)}",
                  "", "")
    table.add_row("files written under egress-ca/ (not the CAs' own)",
                  f"{len(created):,} ({len(created_flood):,} in the flood)", "0", verdict(checks["disk"]))
    table.add_row("  there at the end: files, bytes", f"{len(leaves):,}, {sum(leaves.values()):,}", "", "")
    ratio = p50_during / p50_base
    table.add_row("acme p50: baseline -> during the flood",
                  f"{p50_base * 1000:.2f} -> {p50_during * 1000:.2f} ms ({ratio:.2f}x)",
                  f"<= {p50_factor:g}x", verdict(checks["neighbour_p50"]))
    table.add_row("  acme p50 after the flood (drift check)",
                  f"{statistics.median(after) * 1000:.2f} ms" if after else "n/a", "", "")
    table.add_row("acme p99: baseline -> during -> after",
                  f"{_pct(base, .99) * 1000:.2f} -> {_pct(during, .99) * 1000:.2f} -> "
                  f"{_pct(after, .99) * 1000:.2f} ms", "", "")
    table.add_row("acme requests (baseline, during, after) / failed",
                  f"{len(base)}, {len(during)}, {len(after)} / {base_err + during_err + after_err}",
                  "0 failed", verdict(checks["neighbour_errors"]))
    span = flood_end - flood_start
    table.add_row("mallory names: attempted / through / refused / errors",
                  f"{flooded['attempted']:,} / {through:,} / {sum(refused.values()):,} / "
                  f"{sum(errors.values()):,}", "", "")
    table.add_row("  flood time, names per second", f"{span:.1f} s, {flooded['attempted'] / span:,.0f}",
                  "", "")
    cpu = {"dispatcher_baseline": rss.cpu_share(opened, flood_start),
           "dispatcher_flood": rss.cpu_share(flood_start, flood_end),
           "flood_client": flooded["cpu_seconds"] / span if span > 0 else None}
    table.add_row("CPU, cores: dispatcher baseline / flood; flood client",
                  " / ".join("n/a" if v is None else f"{v:.2f}" for v in cpu.values()), "", "")
    console.print(table)
    for reason, count in sorted({**refused, **errors}.items(), key=lambda kv: -kv[1]):
        console.print(f"  {count:>6,}  {escape(reason)}")
    if created:
        console.print(escape(f"  files written under egress-ca/, e.g. {created[:3]}"))
    valid = through > 0 and sum(errors.values()) <= 0.05 * flooded["attempted"]
    if not valid:
        console.print("[yellow]warning: no name got through, or more than 5% of them failed: the flood did "
                      "not load the proxy as meant (see the errors above and stderr_tails in the JSON)[/]")
    pressure = {"baseline": _pressure(psi[0], psi[1]), "flood": _pressure(psi[1], psi[2])}
    shown = ", ".join(f"{k} {v:.0%}" for k, v in pressure.items() if v is not None)
    console.print("E3 " + ("[green]holds[/]" if all(checks.values()) else "[red]does not hold[/]") +
                  f" (load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
                  f"CPU pressure, the share of time a task waited for a CPU: {shown or 'n/a'})")

    with scratch_schema("info") as db:
        info = machine_info(db)
    info.update({"dnsmasq": dnsmasq, "dns_address": dns, "dispatcher_own_mount_ns": own_mounts,
                 "cpu_pressure_some": pressure, "loadavg_before": load_before,
                 "loadavg_after": load_after})
    t0 = opened
    payload = {
        "benchmark": "egress-flood", "machine": info, "settings": settings, "tenantq": tenantq.__version__,
        "checks": checks, "flood_valid": valid,
        "rss": {"idle_kib": idle_rss, "peak_kib": peak_rss, "hwm_end_kib": hwm_end,
                "after_flood_kib": rss_after_flood[1] if rss_after_flood else None,
                "after_close_kib": rss_after_close[1] if rss_after_close else None,
                "samples": [(round(t - t0, 3), r, h, f) for t, r, h, f in rss.samples]},
        "disk": {"files_at_open": files_at_open, "files_at_end": files_at_end, "created": len(created),
                 "created_in_flood": len(created_flood), "created_examples": created[:20],
                 "writes": watch.writes, "inotify_overflowed": watch.overflowed},
        "neighbour": {"baseline_ms": [s * 1000 for s in base], "during_ms": [s * 1000 for s in during],
                      "after_ms": [s * 1000 for s in after],
                      "errors": {"baseline": base_err, "during": during_err, "after": after_err},
                      "samples": [(round(t - t0, 3), round(s * 1000, 3), e)
                                  for t, s, e in neighbour.samples]},
        "flood": {**flooded, "start": flood_start - t0, "end": flood_end - t0,
                  "sending_ended": flooded["sending_ended"] - t0, "through": through, "refused": refused,
                  "errors": errors},
        "cpu_cores": cpu,
        "dispatcher_batches": batches,
        "stderr_tails": stderr,
    }
    console.print(f"wrote {save('egress-flood', payload)}")
    return payload


def main() -> None:
    """`python -m bench.egress_flood [--names N] [--seconds S] ...`: run() with
    other settings (`./run bench egress-flood` runs the defaults)."""
    import argparse
    import inspect

    parser = argparse.ArgumentParser(prog="python -m bench.egress_flood",
                                     description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, param in inspect.signature(run).parameters.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(param.default), default=param.default,
                            help=HELP[name])
    run(**vars(parser.parse_args()))


if __name__ == "__main__":
    main()
