"""Small HTTP(S) servers on 127.0.0.1 for the egress tests."""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Named(BaseHTTPRequestHandler):
    """Answers with its server's name (and the path, with `echo_path`)."""

    def body(self) -> bytes:
        server: Any = self.server
        return (f"{server.name} {self.path}" if getattr(server, "echo_path", False) else server.name).encode()

    def do_GET(self) -> None:
        body = self.body()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class EchoHeaders(Named):
    def body(self) -> bytes:
        server: Any = self.server
        return json.dumps({"server": server.name, "headers": dict(self.headers)}).encode()


@contextmanager
def serving(names: tuple[str, ...], handler: type[BaseHTTPRequestHandler] = Named, *,
            tls: ssl.SSLContext | None = None, echo_path: bool = False) -> Iterator[dict[str, int]]:
    """Start one server per name; yields name -> port; stops them after."""
    started = []
    for name in names:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.name = name  # type: ignore[attr-defined]
        server.echo_path = echo_path  # type: ignore[attr-defined]
        if tls is not None:
            server.socket = tls.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
    try:
        yield {name: s.server_address[1] for name, s in zip(names, started, strict=True)}
    finally:
        for s in started:
            s.shutdown()
            s.server_close()
