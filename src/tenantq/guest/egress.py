"""Inside the sandbox: make the batch's egress proxy reachable the standard
way. Stdlib only.

The sandbox has no network; the host binds a Unix socket into it
(/tenantq/egress/proxy.sock) behind which the host-side proxy enforces the
tenant's policy. HTTP clients expect a TCP proxy URL, so the batch child
listens on the sandbox's own loopback and forwards each connection to the
socket, and sets HTTP_PROXY / HTTPS_PROXY (urllib, requests, httpx and most
others honour them). This adapter holds no policy: bypassing it gains
nothing, since the socket is the only way out.
"""

from __future__ import annotations

import os
import select
import socket
import threading

SOCKET_PATH = "/tenantq/egress/proxy.sock"
# present when the tenant has host-injected secrets: the proxy terminates TLS
# with this tenant's CA, so it is the only CA the batch's TLS clients trust
CA_PATH = "/tenantq/egress/ca.pem"
CHUNK = 65536
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


def _relay(client: socket.socket) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(SOCKET_PATH)
        pair = {client: upstream, upstream: client}
        open_ends = 2
        while open_ends:
            readable, _, _ = select.select(list(pair), [], [])
            for src in readable:
                data = src.recv(CHUNK)
                if not data:
                    # half-close: pass the EOF on, keep the other direction
                    pair[src].shutdown(socket.SHUT_WR)
                    del pair[src]
                    open_ends -= 1
                    continue
                pair[src].sendall(data)
    except OSError:
        pass
    finally:
        client.close()
        upstream.close()


def _serve(listener: socket.socket) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_relay, args=(client,), daemon=True).start()


def install() -> str | None:
    """Start the forwarder if this batch has an egress proxy; returns its URL."""
    if not os.path.exists(SOCKET_PATH):
        return None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    threading.Thread(target=_serve, args=(listener,), name="egress", daemon=True).start()
    for name in PROXY_VARS:
        os.environ[name] = url
    for name in ("NO_PROXY", "no_proxy"):
        os.environ.pop(name, None)
    if os.path.exists(CA_PATH):
        for name in CA_VARS:
            os.environ[name] = CA_PATH
    return url
