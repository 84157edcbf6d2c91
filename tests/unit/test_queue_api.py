"""`tenantq.Queue` and `tenantq.AsyncQueue` are one API: the same public
methods with the same signatures, every AsyncQueue operation a coroutine
function and no Queue one. The checks are functions returning the drift they
find, so the tests below can also prove that they catch drift (subclasses
that add, change or de-async a method)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from tenantq import AsyncQueue, Queue
from tenantq.client.runner import operation

# a DSN that is never connected to: building either class does no I/O
DSN = "postgresql://nobody@127.0.0.1:1/none"

# Public callables that are plumbing rather than operations (none today:
# the completion listener is `_Runner._listener`, private).
NOT_OPERATIONS: frozenset[str] = frozenset()

# what a user of either class relies on (the set may grow, never lose these)
CORE = frozenset({"enqueue", "enqueue_many", "wait", "job", "cancel", "status", "tenants", "workers",
                  "dead_jobs", "retry_dead", "prune", "reap", "set_tenant", "running_batches",
                  "migrate", "close"})


def public_methods(obj: object) -> dict[str, Any]:
    """name -> bound callable, for every public callable attribute."""
    out: dict[str, Any] = {}
    for name in dir(obj):
        if name.startswith("_"):
            continue
        value = getattr(obj, name)
        if callable(value):
            out[name] = value
    return out


def _describe(sig: inspect.Signature) -> tuple[Any, ...]:
    params = tuple((p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values())
    return (params, sig.return_annotation)


def api_drift(sync_q: object, async_q: object) -> list[str]:
    """Everything that differs between the two classes' public APIs."""
    problems: list[str] = []
    sync_methods, async_methods = public_methods(sync_q), public_methods(async_q)
    for name in sorted(set(sync_methods) - set(async_methods)):
        problems.append(f"{name}: only on {type(sync_q).__name__}")
    for name in sorted(set(async_methods) - set(sync_methods)):
        problems.append(f"{name}: only on {type(async_q).__name__}")
    for name in sorted(set(sync_methods) & set(async_methods)):
        sync_sig = inspect.signature(sync_methods[name])
        async_sig = inspect.signature(async_methods[name])
        if _describe(sync_sig) != _describe(async_sig):
            problems.append(f"{name}: {type(sync_q).__name__}{sync_sig} "
                            f"!= {type(async_q).__name__}{async_sig}")
    return problems


def async_drift(sync_q: object, async_q: object) -> list[str]:
    """Operations that are not coroutine functions on the async class, or are on the sync one."""
    problems: list[str] = []
    for name, method in sorted(public_methods(async_q).items()):
        if name not in NOT_OPERATIONS and not inspect.iscoroutinefunction(method):
            problems.append(f"{type(async_q).__name__}.{name} is not a coroutine function")
    for name, method in sorted(public_methods(sync_q).items()):
        if inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method):
            problems.append(f"{type(sync_q).__name__}.{name} is a coroutine function")
        if inspect.isgeneratorfunction(method):
            problems.append(f"{type(sync_q).__name__}.{name} is a generator function "
                            "(not driven by a runner)")
    return problems


@pytest.fixture
def both() -> tuple[Queue, AsyncQueue]:
    return Queue(DSN, schema="api_test"), AsyncQueue(DSN, schema="api_test")


def test_same_public_methods_and_signatures(both: tuple[Queue, AsyncQueue]) -> None:
    sync_q, async_q = both
    assert api_drift(sync_q, async_q) == []
    names = set(public_methods(sync_q))
    assert names >= CORE, f"missing: {sorted(CORE - names)}"


def test_async_operations_are_coroutine_functions_and_sync_ones_are_not(
        both: tuple[Queue, AsyncQueue]) -> None:
    sync_q, async_q = both
    assert async_drift(sync_q, async_q) == []
    # the allow-list holds only what exists and is sync on both
    for name in NOT_OPERATIONS:
        assert not inspect.iscoroutinefunction(getattr(async_q, name))
        assert not inspect.iscoroutinefunction(getattr(sync_q, name))


def test_operations_are_written_once(both: tuple[Queue, AsyncQueue]) -> None:
    """Every operation but the pool-owning ones is one `operation` object
    shared by both classes: one body, so one behaviour."""
    sync_q, _ = both
    own = {"migrate", "close"}
    for name in set(public_methods(sync_q)) - own - NOT_OPERATIONS:
        found = inspect.getattr_static(Queue, name)
        assert isinstance(found, operation), f"Queue.{name} is not an @operation"
        assert inspect.getattr_static(AsyncQueue, name) is found, name


def test_key_signatures(both: tuple[Queue, AsyncQueue]) -> None:
    for q in both:
        wait = inspect.signature(q.wait).parameters
        assert list(wait) == ["job_id", "timeout"]
        assert wait["timeout"].kind is inspect.Parameter.KEYWORD_ONLY and wait["timeout"].default is None
        enqueue = inspect.signature(q.enqueue).parameters
        for name in ("conn", "actor", "meta"):
            assert enqueue[name].kind is inspect.Parameter.KEYWORD_ONLY and enqueue[name].default is None
        assert inspect.signature(q.enqueue_many).parameters["conn"].default is None


def test_context_managers() -> None:
    assert hasattr(Queue, "__enter__") and hasattr(Queue, "__exit__")
    assert inspect.iscoroutinefunction(AsyncQueue.__aenter__)
    assert inspect.iscoroutinefunction(AsyncQueue.__aexit__)


# -- the checks catch drift ------------------------------------------------------


class AsyncWithExtra(AsyncQueue):
    async def purge_everything(self) -> int:
        return 0


class SyncWithExtra(Queue):
    def purge_everything(self) -> int:
        return 0


class SyncWithOtherDefault(Queue):
    def wait(self, job_id: int, *, timeout: float | None = 5.0) -> Any:  # type: ignore[override]
        return None


class SyncWithOtherKind(Queue):
    def cancel(self, *, job_id: int) -> bool:  # type: ignore[override]
        return False


class AsyncWithSyncMethod(AsyncQueue):
    def cancel(self, job_id: int) -> bool:  # type: ignore[override]  # forgot async
        return False


class SyncWithAsyncMethod(Queue):
    async def cancel(self, job_id: int) -> bool:  # type: ignore[override]
        return False


def test_a_method_added_to_only_the_async_class_is_caught() -> None:
    problems = api_drift(Queue(DSN, schema="s"), AsyncWithExtra(DSN, schema="s"))
    assert problems == ["purge_everything: only on AsyncWithExtra"]


def test_a_method_added_to_only_the_sync_class_is_caught() -> None:
    problems = api_drift(SyncWithExtra(DSN, schema="s"), AsyncQueue(DSN, schema="s"))
    assert problems == ["purge_everything: only on SyncWithExtra"]


@pytest.mark.parametrize("cls", [SyncWithOtherDefault, SyncWithOtherKind])
def test_a_changed_signature_is_caught(cls: type[Queue]) -> None:
    problems = api_drift(cls(DSN, schema="s"), AsyncQueue(DSN, schema="s"))
    assert len(problems) == 1, problems
    assert problems[0].startswith(("wait:", "cancel:")), problems


def test_a_sync_method_on_the_async_class_is_caught() -> None:
    problems = async_drift(Queue(DSN, schema="s"), AsyncWithSyncMethod(DSN, schema="s"))
    assert problems == ["AsyncWithSyncMethod.cancel is not a coroutine function"]


def test_an_async_method_on_the_sync_class_is_caught() -> None:
    problems = async_drift(SyncWithAsyncMethod(DSN, schema="s"), AsyncQueue(DSN, schema="s"))
    assert problems == ["SyncWithAsyncMethod.cancel is a coroutine function"]
