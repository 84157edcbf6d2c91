"""`tenantq.AsyncSandbox`: the Sandbox API for asyncio code.

Generated from the sync classes, not written beside them: every public
method of `Sandbox`, `Filesystem` and `CommandHandle` named below becomes a
coroutine that runs the sync method in a worker thread (`asyncio.to_thread`)
and wraps what it returns (a Sandbox becomes an AsyncSandbox, a
CommandHandle an AsyncCommandHandle). Signatures and docstrings are the sync
ones (`functools.wraps`), and `tests/sandbox_api/test_async.py` proves the
two sides expose the same methods. What blocks is the thread, never the
event loop; `on_stdout`/`on_stderr` callbacks are called from tenantq's
reader thread, as in the sync API (use `loop.call_soon_threadsafe` to reach
the loop from one).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from tenantq.sandbox.api import Sandbox
from tenantq.sandbox.commands import CommandHandle
from tenantq.sandbox.files import Filesystem

SANDBOX_METHODS = ("exec", "run", "set_ttl", "is_running", "delete", "kill", "fork", "fork_many", "close")
SANDBOX_CLASS_METHODS = ("create", "connect", "list")
SANDBOX_ATTRIBUTES = ("id", "template", "metadata", "tenant", "driver", "last_fork", "default_timeout")
FILESYSTEM_METHODS = ("write", "read", "read_text", "list", "exists", "remove", "make_dir")
COMMAND_METHODS = ("send_stdin", "close_stdin", "kill", "wait")


def _wrap(value: Any) -> Any:
    if isinstance(value, Sandbox):
        return AsyncSandbox(value)
    if isinstance(value, CommandHandle):
        return AsyncCommandHandle(value)
    if isinstance(value, list) and value and all(isinstance(v, Sandbox) for v in value):
        return [AsyncSandbox(v) for v in value]
    return value


def _method(cls: type, name: str) -> Callable[..., Any]:
    sync = getattr(cls, name)

    @functools.wraps(sync)
    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _wrap(await asyncio.to_thread(getattr(self._sync, name), *args, **kwargs))

    return method


def _class_method(cls: type, name: str) -> classmethod[Any, Any, Any]:
    # the function under the classmethod: its signature keeps `cls`, which
    # binding to AsyncSandbox then drops, as binding drops it on the sync side
    function = vars(cls)[name].__func__
    bound = getattr(cls, name)

    @functools.wraps(function)
    async def method(_cls: Any, *args: Any, **kwargs: Any) -> Any:
        return _wrap(await asyncio.to_thread(bound, *args, **kwargs))

    return classmethod(method)


def _attribute(name: str) -> property:
    return property(lambda self: getattr(self._sync, name), doc=f"As Sandbox.{name}.")


class AsyncFilesystem:
    # made below from Filesystem's methods (the types for checkers)
    write: Callable[..., Awaitable[int]]
    read: Callable[..., Awaitable[bytes]]
    read_text: Callable[..., Awaitable[str]]
    list: Callable[..., Awaitable[Any]]
    exists: Callable[..., Awaitable[bool]]
    remove: Callable[..., Awaitable[None]]
    make_dir: Callable[..., Awaitable[bool]]

    def __init__(self, sync: Filesystem) -> None:
        self._sync = sync


class AsyncCommandHandle:
    """A background command (`await sbx.exec(..., background=True)`)."""

    send_stdin: Callable[..., Awaitable[None]]
    close_stdin: Callable[..., Awaitable[None]]
    kill: Callable[..., Awaitable[bool]]
    wait: Callable[..., Awaitable[Any]]

    def __init__(self, sync: CommandHandle) -> None:
        self._sync = sync

    @property
    def pid(self) -> int | None:
        return self._sync.pid


class AsyncSandbox:
    """A running sandbox, for asyncio: `await AsyncSandbox.create(...)`;
    `async with` deletes it."""

    create: ClassVar[Callable[..., Awaitable[AsyncSandbox]]]
    connect: ClassVar[Callable[..., Awaitable[AsyncSandbox]]]
    list: ClassVar[Callable[..., Awaitable[Any]]]
    exec: Callable[..., Awaitable[Any]]
    run: Callable[..., Awaitable[Any]]
    set_ttl: Callable[..., Awaitable[None]]
    is_running: Callable[..., Awaitable[bool]]
    delete: Callable[..., Awaitable[bool]]
    kill: Callable[..., Awaitable[bool]]
    fork: Callable[..., Awaitable[AsyncSandbox]]
    fork_many: Callable[..., Awaitable[Any]]
    close: Callable[..., Awaitable[None]]
    id: str
    template: str
    metadata: dict[str, str]
    tenant: str | None
    driver: str
    last_fork: Any
    default_timeout: float

    def __init__(self, sync: Sandbox) -> None:
        self._sync = sync
        self.filesystem = AsyncFilesystem(sync.filesystem)

    @property
    def sync(self) -> Sandbox:
        """The same sandbox, for sync code."""
        return self._sync

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self._sync.delete)

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self._sync.id}>"


for _name in SANDBOX_METHODS:
    setattr(AsyncSandbox, _name, _method(Sandbox, _name))
for _name in SANDBOX_CLASS_METHODS:
    setattr(AsyncSandbox, _name, _class_method(Sandbox, _name))
for _name in SANDBOX_ATTRIBUTES:
    setattr(AsyncSandbox, _name, _attribute(_name))
for _name in FILESYSTEM_METHODS:
    setattr(AsyncFilesystem, _name, _method(Filesystem, _name))
for _name in COMMAND_METHODS:
    setattr(AsyncCommandHandle, _name, _method(CommandHandle, _name))
