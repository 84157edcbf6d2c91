"""Handlers: `@tenantq.handler(kind, ...)` registers a function for a kind."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from tenantq.errors import InvalidInput
from tenantq.store import validation

Isolation = Literal["sandbox", "inline"]


@dataclass(frozen=True)
class JobContext:
    """What a handler knows about the job it runs."""

    tenant: str
    job_id: int
    attempt: int
    kind: str
    max_attempts: int
    env: Mapping[str, str] = field(default_factory=dict)


HandlerFunc = Callable[[Any, JobContext], Any]
F = TypeVar("F", bound=HandlerFunc)


@dataclass(frozen=True)
class Handler:
    kind: str
    func: HandlerFunc
    timeout: float
    memory_mb: int
    isolation: Isolation
    # refuse to run in the dispatcher process even on an inline worker
    sandbox_only: bool = False


class Registry:
    """Kind -> handler. The module-level REGISTRY is what `handler` fills."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    def add(self, handler: Handler) -> None:
        existing = self._handlers.get(handler.kind)
        if existing is not None and existing.func is not handler.func:
            raise InvalidInput(f"kind {handler.kind!r} already has a handler ({_name(existing.func)})")
        self._handlers[handler.kind] = handler

    def get(self, kind: str) -> Handler | None:
        return self._handlers.get(kind)

    def kinds(self) -> list[str]:
        return sorted(self._handlers)

    def __contains__(self, kind: object) -> bool:
        return kind in self._handlers


REGISTRY = Registry()


def handler(
    kind: str,
    *,
    timeout: float = 60,
    memory_mb: int = 256,
    isolation: Isolation = "sandbox",
    sandbox_only: bool = False,
    registry: Registry | None = None,
) -> Callable[[F], F]:
    """Register `func(payload, ctx)` as the handler of `kind`.

    `isolation="inline"` marks a trusted first-party kind that may run in
    the dispatcher process; everything else runs sandboxed when the worker
    has a sandbox driver.
    """
    validation.kind(kind)
    if timeout <= 0:
        raise InvalidInput(f"handler {kind!r}: timeout must be positive, got {timeout}")
    if memory_mb < 16:
        raise InvalidInput(f"handler {kind!r}: memory_mb must be at least 16, got {memory_mb}")
    if isolation not in ("sandbox", "inline"):
        raise InvalidInput(f"handler {kind!r}: isolation must be 'sandbox' or 'inline'")

    def register(func: F) -> F:
        (registry or REGISTRY).add(Handler(kind, func, float(timeout), memory_mb, isolation, sandbox_only))
        return func

    return register


def load_app(module: str) -> str:
    """Import the app module that registers handlers; returns its file path.

    The current directory is put on sys.path first, as `python -m` would.
    """
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:
        raise InvalidInput(f"cannot import app module {module!r}: {exc}") from None
    return str(getattr(imported, "__file__", module))


def _name(func: Callable[..., Any]) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', '?')}"
