"""Handlers for the egress tests: what a job can reach, and how it fails."""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from typing import Any

import tenantq


def _get(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=15) as resp:
            return {"ok": True, "status": resp.status, "body": resp.read().decode()}
    except urllib.error.HTTPError as exc:
        return {"ok": False, "status": exc.code, "error": f"{exc.code} {exc.reason}"}
    except (urllib.error.URLError, OSError) as exc:
        return {"ok": False, "error": str(getattr(exc, "reason", exc))}


@tenantq.handler("net.get", timeout=30, memory_mb=128)
def get(payload: dict[str, Any], ctx: tenantq.JobContext) -> list[dict[str, Any]]:
    """GET each URL through whatever the sandbox offers (HTTP_PROXY)."""
    return [_get(url) for url in payload["urls"]]


@tenantq.handler("net.narrowed", timeout=30, memory_mb=128, egress=["localhost"])
def narrowed(payload: dict[str, Any], ctx: tenantq.JobContext) -> list[dict[str, Any]]:
    """Same, but its handler allows only localhost:80/443 whatever the tenant allows."""
    return [_get(url) for url in payload["urls"]]


@tenantq.handler("net.direct", timeout=30, memory_mb=128)
def direct(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Try to get out without the proxy: TCP to addresses, and any Unix socket
    path given (another batch's proxy)."""
    out: dict[str, Any] = {"tcp": {}, "unix": {}, "egress_dir": None}
    for host, port in payload.get("tcp", []):
        try:
            with socket.create_connection((host, port), timeout=5):
                out["tcp"][f"{host}:{port}"] = "connected"
        except OSError as exc:
            out["tcp"][f"{host}:{port}"] = f"{type(exc).__name__}: {exc}"
    for path in payload.get("unix", []):
        try:
            # through the directory (a socket address holds only 107 bytes)
            dir_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(5)
                    s.connect(f"/proc/self/fd/{dir_fd}/{os.path.basename(path)}")
                    out["unix"][path] = "connected"
            finally:
                os.close(dir_fd)
        except OSError as exc:
            out["unix"][path] = f"{type(exc).__name__}: {exc}"
    if os.path.isdir("/tenantq/egress"):
        out["egress_dir"] = sorted(os.listdir("/tenantq/egress"))
    out["proxy_env"] = os.environ.get("HTTPS_PROXY")
    return out


@tenantq.handler("net.secret_probe", timeout=60, memory_mb=128)
def secret_probe(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Use the injected secret, try to send its placeholder elsewhere, then
    hold still (marker file) while the test scans the sandbox's memory."""
    import time

    key = os.environ.get("API_KEY", "")
    out: dict[str, Any] = {"env_value": key, "ctx_value": ctx.env.get("API_KEY"),
                           "ssl_cert_file": os.environ.get("SSL_CERT_FILE")}
    out["stripe"] = _get(payload["stripe"])
    leak = urllib.request.Request(payload["other"], headers={"X-Exfil": key})
    try:
        with urllib.request.urlopen(leak, timeout=15) as resp:
            out["leak"] = {"ok": True, "status": resp.status}
    except urllib.error.HTTPError as exc:
        out["leak"] = {"ok": False, "status": exc.code, "error": f"{exc.code} {exc.reason}"}
    with open("probed", "w") as fh:
        fh.write("ready for the memory scan")
    deadline = time.monotonic() + 40
    while not os.path.exists("release") and time.monotonic() < deadline:
        time.sleep(0.05)
    return out


@tenantq.handler("net.hold", timeout=60, memory_mb=128)
def hold(payload: dict[str, Any], ctx: tenantq.JobContext) -> str:
    """Keep the batch (and its egress proxy) open until the test releases it."""
    import time

    with open("holding", "w") as fh:
        fh.write("holding")
    deadline = time.monotonic() + 45
    while not os.path.exists("release") and time.monotonic() < deadline:
        time.sleep(0.05)
    return "released"
