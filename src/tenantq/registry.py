"""Handlers: `@tenantq.handler(kind, ...)` registers a function for a kind."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from tenantq.egress.policy import Rule, parse_rules
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
    # "module:function" that prepares what this handler needs (imports, a
    # loaded model); run once per sandbox parent, so templates capture it
    warmup: str | None = None
    # narrows the tenant's egress rules while this handler runs (never widens)
    egress: tuple[Rule, ...] | None = None


class Registry:
    """Kind -> handler. The module-level REGISTRY is what `handler` fills."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        # warmup name -> the function when registered by decorator (None:
        # resolve "module:function" on first use), in registration order
        self._warmups: dict[str, Callable[[], Any] | None] = {}

    def add(self, handler: Handler) -> None:
        existing = self._handlers.get(handler.kind)
        if existing is not None and existing.func is not handler.func:
            raise InvalidInput(f"kind {handler.kind!r} already has a handler ({_name(existing.func)})")
        self._handlers[handler.kind] = handler
        if handler.warmup is not None:
            self._warmups.setdefault(handler.warmup, None)

    def add_warmup(self, name: str, func: Callable[[], Any] | None = None) -> None:
        self._warmups[name] = func

    def warmups(self, kinds: list[str] | None = None) -> list[str]:
        """Warmup names in registration order: app-level ones plus those of
        the given kinds' handlers (all handlers when `kinds` is None)."""
        if kinds is None:
            return list(self._warmups)
        wanted = {h.warmup for k in kinds if (h := self._handlers.get(k)) is not None and h.warmup}
        per_handler = {h.warmup for h in self._handlers.values() if h.warmup}
        return [n for n in self._warmups if n in wanted or n not in per_handler]

    def resolve_warmup(self, name: str) -> Callable[[], Any]:
        func = self._warmups.get(name)
        if func is not None:
            return func
        module, _, attr = name.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise InvalidInput(f"warmup {name!r}: {exc}") from None
        if not callable(target):
            raise InvalidInput(f"warmup {name!r} is not callable")
        return target  # type: ignore[no-any-return]

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
    warmup: str | None = None,
    egress: list[str] | None = None,
    registry: Registry | None = None,
) -> Callable[[F], F]:
    """Register `func(payload, ctx)` as the handler of `kind`.

    `isolation="inline"` marks a trusted first-party kind that may run in
    the dispatcher process; everything else runs sandboxed when the worker
    has a sandbox driver. `warmup="module:function"` names code that imports
    and prepares what the handler needs; it runs once per sandbox parent
    (and is baked into the template snapshot), not once per job.
    `egress=["api.stripe.com"]` narrows what the tenant's egress rules allow
    while this handler runs; it can never allow more than the tenant's rules.
    """
    validation.kind(kind)
    if timeout <= 0:
        raise InvalidInput(f"handler {kind!r}: timeout must be positive, got {timeout}")
    if memory_mb < 16:
        raise InvalidInput(f"handler {kind!r}: memory_mb must be at least 16, got {memory_mb}")
    if isolation not in ("sandbox", "inline"):
        raise InvalidInput(f"handler {kind!r}: isolation must be 'sandbox' or 'inline'")
    if warmup is not None and not _is_warmup_name(warmup):
        raise InvalidInput(f"handler {kind!r}: warmup must be 'module:function', got {warmup!r}")

    narrowed = None if egress is None else parse_rules(egress)

    def register(func: F) -> F:
        (registry or REGISTRY).add(Handler(kind, func, float(timeout), memory_mb, isolation, sandbox_only,
                                           warmup, narrowed))
        return func

    return register


W = TypeVar("W", bound=Callable[[], Any])


def warmup(func: W) -> W:
    """App-level warmup: `@tenantq.warmup` on a no-argument function that
    imports and prepares what every handler needs. It runs once in each
    sandbox parent before any batch (and in the template snapshot)."""
    REGISTRY.add_warmup(f"{func.__module__}:{func.__qualname__}", func)
    return func


def _is_warmup_name(name: str) -> bool:
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr.isidentifier()
                and all(part.isidentifier() for part in module.split(".")))


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
