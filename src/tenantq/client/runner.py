"""Driving operations (generators of steps, store/steps.py) on a sync or an
async connection: the one place where `Queue` and `AsyncQueue` differ.

`@operation` turns a generator method of `client.operations.Operations`
into a method of both classes: on a `SyncRunner` (Queue) calling it runs
the steps and returns the result; on an `AsyncRunner` (AsyncQueue) it
returns a coroutine. Signatures, defaults, validation and SQL are the
generator's, so the two classes cannot drift apart
(tests/unit/test_queue_api.py compares them).

Steps besides `Query` and `Copy` (store/steps.py): `Subscribe(job_id)` registers a waiter with the
process's completion listener (answered with the Waiter); `Wait(waiter,
timeout)` blocks or awaits it (answered True when woken). A pool connection
is held only across consecutive queries and returned before a wait, so a
thousand waiters hold no connection while they wait.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import psycopg
from psycopg.pq import TransactionStatus

from tenantq.client import connections, listener
from tenantq.client.listener import CompletionListener, Waiter
from tenantq.errors import TenantqError
from tenantq.store.db import Database
from tenantq.store.steps import Copy, Query, Steps, async_execute, execute

# On tenantq's own pool a statement refused for a deadlock or a
# serialization failure rolled back alone (autocommit, or an atomic
# operation's own transaction): it is run again, up to this many times in
# all. On a caller's connection the caller's transaction is aborted, and
# retrying it is the caller's to do.
RETRIES = 3

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class Subscribe:
    job_id: int


@dataclass(frozen=True)
class Wait:
    waiter: Waiter
    timeout: float | None


class operation(Generic[P, T]):  # lower case: a decorator, like property
    """A method written once as steps; see the module docstring.

    `atomic`: its statements run in one transaction (a savepoint inside
    the caller's, with `conn=`); such an operation only queries.
    """

    def __init__(self, steps: Callable[Concatenate[Any, P], Steps[T]], *, atomic: bool = False) -> None:
        self.steps = steps
        self.atomic = atomic
        self.name = steps.__name__
        functools.update_wrapper(self, steps)  # type: ignore[arg-type]
        signature = inspect.signature(steps)
        # `-> Steps[int]` is the generator's; the method returns (or, async, awaits to) an int
        returns = signature.return_annotation
        if isinstance(returns, str) and returns.startswith("Steps[") and returns.endswith("]"):
            returns = returns[len("Steps["):-1]
        self.signature = signature.replace(parameters=list(signature.parameters.values())[1:],
                                           return_annotation=returns)

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> operation[P, T]: ...
    @overload
    def __get__(self, obj: AsyncRunner, owner: type[Any]) -> Callable[P, Awaitable[T]]: ...
    @overload
    def __get__(self, obj: SyncRunner, owner: type[Any]) -> Callable[P, T]: ...

    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self
        op = self
        if isinstance(obj, AsyncRunner):
            async def bound_async(*args: Any, **kwargs: Any) -> Any:
                return await obj._drive(op, lambda: op.steps(obj, *args, **kwargs), kwargs.get("conn"))
            bound: Callable[..., Any] = bound_async
        else:
            def bound_sync(*args: Any, **kwargs: Any) -> Any:
                return obj._drive(op, lambda: op.steps(obj, *args, **kwargs), kwargs.get("conn"))
            bound = bound_sync
        functools.update_wrapper(bound, self.steps)
        bound.__signature__ = self.signature  # type: ignore[attr-defined]
        # made once per queue: the instance's attribute now shadows this
        # (non-data) descriptor, so `q.enqueue(...)` does not rebuild it per call
        obj.__dict__[self.name] = bound
        return bound


def atomic_operation(steps: Callable[Concatenate[Any, P], Steps[T]]) -> operation[P, T]:
    """`@operation` whose statements run in one transaction."""
    return operation(steps, atomic=True)


def _missing_tables(db: Database, exc: psycopg.errors.UndefinedTable, *, caller: bool) -> TenantqError:
    where = "on the connection you passed (conn=)" if caller else f"in schema {db.schema!r}"
    return TenantqError(f"tenantq tables not found {where}: run `tenantq migrate` against that database "
                        f"first ({str(exc).splitlines()[0]})")


class _Runner:
    db: Database
    _waits: CompletionListener | None = None

    def _listener(self) -> CompletionListener:
        """The process's completion listener, taken on this queue's first
        wait and released by its close()."""
        if self._waits is None:
            self._waits = listener.acquire(self.db)
        return self._waits

    def _release_listener(self) -> None:
        if self._waits is not None:
            self._waits = None
            listener.release(self.db)


class SyncRunner(_Runner):
    """Runs operations on tenantq's pool, or on the caller's connection."""

    def _pool_connection(self) -> Any:
        raise NotImplementedError

    def _drive(self, op: operation[Any, Any], make: Callable[[], Steps[Any]], caller: object) -> Any:
        try:
            if caller is not None:
                return self._steps(op, make(), lambda: _borrowed(connections.sync_connection(caller)))
            for attempt in range(RETRIES):
                try:
                    return self._steps(op, make(), self._pool_connection)
                except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                    if attempt == RETRIES - 1:
                        raise
            raise AssertionError("unreachable")
        except psycopg.errors.UndefinedTable as exc:
            raise _missing_tables(self.db, exc, caller=caller is not None) from None

    def _steps(self, op: operation[Any, Any], steps: Steps[Any], source: Callable[[], Any]) -> Any:
        waiters: list[Waiter] = []
        held: Any = None
        conn: psycopg.Connection[Any] | None = None
        transaction: Any = None
        try:
            step = next(steps)
            while True:
                if isinstance(step, Query | Copy):
                    if conn is None:
                        held = source()
                        conn = held.__enter__()
                        if op.atomic:
                            transaction = _atomic_block(conn)
                            transaction.__enter__()
                    try:
                        rows = execute(conn, step)
                    except psycopg.Error as exc:
                        step = steps.throw(exc)
                    else:
                        step = steps.send(rows)
                    continue
                if held is not None:  # never hold a connection while waiting
                    assert transaction is None, f"{op.name}: an atomic operation cannot wait"
                    held.__exit__(None, None, None)
                    held = conn = None
                if isinstance(step, Subscribe):
                    waiters.append(self._listener().subscribe(step.job_id))
                    step = steps.send(waiters[-1])
                elif isinstance(step, Wait):
                    step = steps.send(self._listener().wait(step.waiter, step.timeout))
                else:
                    raise TypeError(f"{op.name}: unknown step {step!r}")
        except StopIteration as done:
            if transaction is not None:
                transaction.__exit__(None, None, None)
                transaction = None
            return done.value
        except BaseException as exc:
            if transaction is not None:
                transaction.__exit__(type(exc), exc, exc.__traceback__)
                transaction = None
            raise
        finally:
            if held is not None:
                held.__exit__(None, None, None)
            for waiter in waiters:
                self._listener().unsubscribe(waiter)


class AsyncRunner(_Runner):
    """`SyncRunner`, awaiting: on tenantq's async pool or the caller's AsyncConnection."""

    async def _pool_connection(self) -> Any:
        raise NotImplementedError

    async def _drive(self, op: operation[Any, Any], make: Callable[[], Steps[Any]], caller: object) -> Any:
        try:
            if caller is not None:
                conn = await connections.async_connection(caller)
                return await self._steps(op, make(), conn)
            for attempt in range(RETRIES):
                try:
                    return await self._steps(op, make(), None)
                except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                    if attempt == RETRIES - 1:
                        raise
            raise AssertionError("unreachable")
        except psycopg.errors.UndefinedTable as exc:
            raise _missing_tables(self.db, exc, caller=caller is not None) from None

    async def _steps(self, op: operation[Any, Any], steps: Steps[Any],
                     caller: psycopg.AsyncConnection[Any] | None) -> Any:
        waiters: list[Waiter] = []
        held: Any = None
        conn: psycopg.AsyncConnection[Any] | None = caller
        transaction: Any = None
        try:
            step = next(steps)
            while True:
                if isinstance(step, Query | Copy):
                    if conn is None:
                        held = await self._pool_connection()
                        conn = await held.__aenter__()
                    if op.atomic and transaction is None:
                        transaction = _atomic_block(conn)
                        await transaction.__aenter__()
                    try:
                        rows = await async_execute(conn, step)
                    except psycopg.Error as exc:
                        step = steps.throw(exc)
                    else:
                        step = steps.send(rows)
                    continue
                assert transaction is None, f"{op.name}: an atomic operation cannot wait"
                if held is not None:
                    await held.__aexit__(None, None, None)
                    held = None
                    conn = caller
                if isinstance(step, Subscribe):
                    # LISTEN is set up by a thread: do not block the loop on it
                    waiters.append(await asyncio.to_thread(self._listener().subscribe, step.job_id))
                    step = steps.send(waiters[-1])
                elif isinstance(step, Wait):
                    step = steps.send(await self._listener().async_wait(step.waiter, step.timeout))
                else:
                    raise TypeError(f"{op.name}: unknown step {step!r}")
        except StopIteration as done:
            if transaction is not None:
                await transaction.__aexit__(None, None, None)
                transaction = None
            return done.value
        except BaseException as exc:
            if transaction is not None:
                await transaction.__aexit__(type(exc), exc, exc.__traceback__)
                transaction = None
            raise
        finally:
            if held is not None:
                await held.__aexit__(None, None, None)
            for waiter in waiters:
                self._listener().unsubscribe(waiter)


def _atomic_block(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> Any:
    """Where an atomic operation's statements run: a transaction of its own
    on a connection in autocommit mode (tenantq's pool, or a caller's), a
    savepoint inside a transaction already open. On a caller's connection
    that is not in autocommit mode and has no transaction open yet, its
    statements begin the caller's transaction, which the caller commits:
    psycopg's `transaction()` would begin and commit one of its own there."""
    if not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        return nullcontext()
    return conn.transaction()


@contextmanager
def _borrowed(conn: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """The caller's connection, as a context that leaves it as it was."""
    yield conn
