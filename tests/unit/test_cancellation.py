"""`ctx.cancelled` (registry.Cancellation): its Event is made on first use,
so these pin what a handler relies on whatever the order of set and wait."""

from __future__ import annotations

import threading

from tenantq.registry import Cancellation


def test_a_set_before_any_wait_is_seen_at_once() -> None:
    flag = Cancellation()
    assert not flag and not flag.is_set()
    flag.set()
    assert flag and flag.is_set()
    assert flag.wait(30) is True


def test_a_wait_times_out_when_nobody_sets_it() -> None:
    assert Cancellation().wait(0.01) is False


def test_a_set_from_another_thread_wakes_every_waiter() -> None:
    flag = Cancellation()
    woke: list[bool] = []
    waiting = threading.Barrier(4)

    def waiter() -> None:
        waiting.wait()
        woke.append(flag.wait(30))

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    waiting.wait()  # the waiters are at (or about to reach) their wait
    flag.set()
    for t in threads:
        t.join(30)
    assert woke == [True, True, True]


def test_set_racing_the_first_wait_is_never_missed() -> None:
    # the window the lazy Event opens: set() between wait()'s flag check
    # and its making the Event; many rounds so that some land inside it
    for _ in range(300):
        flag = Cancellation()
        setter = threading.Thread(target=flag.set)
        setter.start()
        assert flag.wait(30) is True
        setter.join(30)
