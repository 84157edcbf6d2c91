"""Completion notifications: one LISTEN connection per process and database.

The statements that end jobs (settle, cancel, the reaper) notify the ids of
the jobs that ended on the schema's done channel, at commit
(jobs.sql `settle`). One daemon thread per (server, schema) listens and
wakes exactly the waiters of those ids; sync waiters block on an Event,
async ones await a future resolved on their own loop
(`call_soon_threadsafe`), so a thousand waiters, sync or async, cost one
connection. Waiters subscribe *before* they read the job's status, so a
notification can never fall between the read and the wait.

Notifications are lost while the connection is down: the thread then wakes
every waiter (each re-reads its job) and, until LISTEN is back, waits
return after at most FALLBACK_POLL_SECONDS so that waiters poll; once
reconnected it wakes every waiter once more (what ended meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field

from psycopg import sql as pgsql

from tenantq.store.db import Database

# how often waiters re-read their job while notifications cannot arrive
FALLBACK_POLL_SECONDS = 1.0
# how long a first subscriber waits for LISTEN before polling instead
LISTEN_READY_SECONDS = 5.0
# how often the thread looks up from the socket (to notice close())
IDLE_SECONDS = 0.2
RECONNECT_SECONDS = (0.2, 5.0)
APPLICATION_NAME = "tenantq-waits"

log = logging.getLogger("tenantq.waits")


@dataclass(eq=False)
class Waiter:
    """One `wait()` call's subscription to one job's end."""

    job_id: int
    event: threading.Event = field(default_factory=threading.Event)
    futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wake(self) -> None:
        with self.lock:
            self.event.set()
            futures = list(self.futures)
        for loop, future in futures:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits the future any more
                loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class CompletionListener:
    """The LISTEN thread of one database and schema (see the module docstring)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._waiters: dict[int, set[Waiter]] = {}
        self._lock = threading.Lock()
        self._listening = threading.Event()
        # set after the thread's first attempt to LISTEN, whatever came of it
        self._tried = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- subscribers -----------------------------------------------------------
    def subscribe(self, job_id: int) -> Waiter:
        """Register a waiter for `job_id`; returns once LISTEN is active (or,
        if it cannot be, at once: the waiter then polls)."""
        waiter = Waiter(job_id)
        with self._lock:
            self._waiters.setdefault(job_id, set()).add(waiter)
            if self._thread is None:
                self._thread = threading.Thread(target=self._listen, name="tenantq-waits", daemon=True)
                self._thread.start()
        self._tried.wait(LISTEN_READY_SECONDS)
        return waiter

    def unsubscribe(self, waiter: Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get(waiter.job_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[waiter.job_id]

    def _slice(self, timeout: float | None) -> float | None:
        if self._listening.is_set():
            return timeout
        return FALLBACK_POLL_SECONDS if timeout is None else min(timeout, FALLBACK_POLL_SECONDS)

    def wait(self, waiter: Waiter, timeout: float | None) -> bool:
        """Block until the waiter is woken (True) or `timeout` passes; while
        notifications cannot arrive, at most FALLBACK_POLL_SECONDS."""
        woken = waiter.event.wait(self._slice(timeout))
        waiter.event.clear()
        return woken

    async def async_wait(self, waiter: Waiter, timeout: float | None) -> bool:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with waiter.lock:
            waiter.futures.append((loop, future))
            if waiter.event.is_set():
                future.set_result(None)
        try:
            await asyncio.wait_for(future, self._slice(timeout))
            return True
        except TimeoutError:
            return False
        finally:
            with waiter.lock:
                waiter.futures.remove((loop, future))
                waiter.event.clear()

    def waiting(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._waiters.values())

    # -- the thread --------------------------------------------------------------
    def _wake(self, payload: str) -> None:
        with self._lock:
            if payload == "*":
                targets = [w for ws in self._waiters.values() for w in ws]
            else:
                targets = []
                for part in payload.split(","):
                    if part.isdigit():
                        targets.extend(self._waiters.get(int(part), ()))
        for waiter in targets:
            waiter.wake()

    def _listen(self) -> None:
        backoff = RECONNECT_SECONDS[0]
        while not self._stop.is_set():
            try:
                with self.db.connect(application_name=APPLICATION_NAME) as conn:
                    conn.execute(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(self.db.done_channel)))
                    self._listening.set()
                    self._tried.set()
                    self._wake("*")  # whatever ended while nobody listened
                    backoff = RECONNECT_SECONDS[0]
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=IDLE_SECONDS):
                            self._wake(note.payload)
            except Exception as exc:  # the thread must outlive any error: waiters poll meanwhile
                if self._listening.is_set():
                    log.warning("tenantq: lost the connection that waits for job ends (%s); polling every "
                                "%.0f s until it is back", str(exc).splitlines()[0] if str(exc) else exc,
                                FALLBACK_POLL_SECONDS)
                self._listening.clear()
                self._tried.set()
                self._wake("*")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, RECONNECT_SECONDS[1])


    def close(self) -> None:
        """Stop the thread and its connection (within IDLE_SECONDS); whoever
        still waits re-reads its job and polls."""
        self._stop.set()
        self._wake("*")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(IDLE_SECONDS + 5)


# (dsn, schema) -> the listener and how many open queues use it
_listeners: dict[tuple[str, str], tuple[CompletionListener, int]] = {}
_listeners_lock = threading.Lock()


def listener_for(db: Database) -> CompletionListener:
    """The process's listener for this database and schema (made if need
    be), without taking a reference: queues use `acquire`."""
    key = (db.dsn, db.schema)
    with _listeners_lock:
        found, users = _listeners.get(key, (None, 0))
        if found is None:
            found = CompletionListener(db)
            _listeners[key] = (found, users)
        return found


def acquire(db: Database) -> CompletionListener:
    """The process's listener for this database and schema, for one more
    queue; `release` it when that queue closes."""
    key = (db.dsn, db.schema)
    with _listeners_lock:
        found, users = _listeners.get(key, (None, 0))
        if found is None:
            found = CompletionListener(db)
        _listeners[key] = (found, users + 1)
        return found


def release(db: Database) -> None:
    """One queue less: the last one stops the listener."""
    key = (db.dsn, db.schema)
    with _listeners_lock:
        found, users = _listeners.get(key, (None, 0))
        if found is None:
            return
        if users > 1:
            _listeners[key] = (found, users - 1)
            return
        del _listeners[key]
    found.close()
