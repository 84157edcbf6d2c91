"""A client object, for code written against hosted sandbox SDKs that go
through one: `Client().sandboxes.create(...)` takes the same arguments as
`Sandbox.create` and returns the same `Sandbox` (one implementation: these
are the class's own methods)."""

from __future__ import annotations

from tenantq.sandbox.api import Sandbox


class Sandboxes:
    create = staticmethod(Sandbox.create)


class Client:
    def __init__(self) -> None:
        self.sandboxes = Sandboxes()
