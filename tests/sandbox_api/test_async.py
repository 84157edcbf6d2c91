"""`tenantq.AsyncSandbox`: the same API for asyncio, made from the sync one
(sandbox/aio.py). The two sides expose the same methods with the same
signatures, and a real sandbox is driven from an event loop that never
blocks while it waits."""

from __future__ import annotations

import asyncio
import inspect
import time
from pathlib import Path

import pytest

from tenantq import AsyncSandbox, Sandbox
from tenantq.sandbox import aio
from tenantq.sandbox.commands import CommandHandle
from tenantq.sandbox.files import Filesystem

# what the sync Sandbox has beyond the documented API: the parts other
# modules of tenantq use (the pool, fork, the CLI, the queue's executor), not for users
SANDBOX_INTERNAL = {"watch", "link", "oom_count", "end_reason", "sync", "hand_over", "hand_out",
                    "checkpoint_and_stop", "assign", "adopt", "start_egress"}


def public(cls: type) -> set[str]:
    """Its public methods, inherited ones included (Sandbox's state and the
    methods its parts share are in sandbox/core.py)."""
    return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))
            and not isinstance(inspect.getattr_static(cls, n), property)}


@pytest.mark.parametrize(("sync_cls", "async_cls", "skip"), [
    (Sandbox, AsyncSandbox, SANDBOX_INTERNAL),
    (Filesystem, aio.AsyncFilesystem, set()),
    (CommandHandle, aio.AsyncCommandHandle, set()),
])
def test_both_sides_have_the_same_methods_and_signatures(sync_cls: type, async_cls: type,
                                                         skip: set[str]) -> None:
    assert public(sync_cls) - skip == public(async_cls) - skip
    for name in public(sync_cls) - skip:
        sync, made = getattr(sync_cls, name), getattr(async_cls, name)
        assert inspect.iscoroutinefunction(made), name
        assert not inspect.iscoroutinefunction(sync), name
        assert inspect.signature(made) == inspect.signature(sync), name


def test_a_method_added_to_the_sync_side_only_is_caught() -> None:
    class Grown(Sandbox):
        def snapshot(self) -> None: ...

    assert public(Grown) - SANDBOX_INTERNAL - public(AsyncSandbox) == {"snapshot"}


def test_a_sandbox_driven_from_an_event_loop(driver_name: str, data_dir: Path) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create(driver=driver_name, ttl_seconds=120, metadata={"via": "asyncio"},
                                             secrets={"TOKEN": "t-1"}) as sbx:
            assert (await AsyncSandbox.list(metadata={"via": "asyncio"}))[0].id == sbx.id
            await sbx.filesystem.write("/work/in.txt", "21")
            assert await sbx.filesystem.exists("/work/in.txt")
            result = await sbx.run("echo $(( $(cat /work/in.txt) * 2 )) $TOKEN")
            assert result.stdout == "42 t-1\n", result
            # the loop keeps running while a command waits in its thread
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            started = time.monotonic()
            slow = await sbx.run("sleep 0.5")
            ticker.cancel()
            assert slow.ok and time.monotonic() - started >= 0.5 and ticks >= 20, ticks
            handle = await sbx.exec("read line; echo got $line", background=True)
            assert isinstance(handle, aio.AsyncCommandHandle) and handle.pid is not None
            await handle.send_stdin("x\n")
            assert (await handle.wait(timeout=30)).stdout == "got x\n"
            assert (await sbx.filesystem.read_text("/work/in.txt")) == "21"
            if driver_name == "gvisor":
                child = await sbx.fork()
                assert isinstance(child, AsyncSandbox) and child.id != sbx.id
                await child.filesystem.write("/work/in.txt", "child")
                assert await sbx.filesystem.read_text("/work/in.txt") == "21"
                assert await child.delete() is True
        assert await sbx.is_running() is False
        assert await sbx.delete() is False

    asyncio.run(main())
