"""Wake idle slots: LISTEN/NOTIFY with a polling fallback.

Enqueues NOTIFY the schema's channel in their transaction, so a wake-up is
delivered only once the jobs are visible. Slots wait on a generation
counter: a notification that arrives between a slot's empty claim and its
wait still wakes it (the generation moved), and a lost connection only
degrades wake-ups to the poll interval until the listener reconnects.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg
from psycopg import sql as pgsql

from tenantq.dispatch.cancels import parse_notification
from tenantq.store.db import Database

log = logging.getLogger("tenantq.wakeup")


class Wakeup:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generation = 0

    @property
    def generation(self) -> int:
        with self._cond:
            return self._generation

    def fire(self) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def wait(self, seen_generation: int, timeout: float) -> None:
        """Return when the generation moves past `seen_generation` or after `timeout`."""
        with self._cond:
            self._cond.wait_for(lambda: self._generation != seen_generation, timeout=timeout)


class Listener(threading.Thread):
    """A dedicated connection that LISTENs and fires the Wakeup."""

    def __init__(
        self,
        db: Database,
        wakeup: Wakeup,
        stopping: threading.Event,
        *,
        on_interactive: Callable[[], None] | None = None,
        on_cancel: Callable[[int, int], object] | None = None,
    ) -> None:
        super().__init__(name="tenantq-listener", daemon=True)
        self.on_interactive = on_interactive
        self.on_cancel = on_cancel
        self.db = db
        self.wakeup = wakeup
        self.stopping = stopping
        self.listening = threading.Event()

    def run(self) -> None:
        retry_delay = 0.5
        while not self.stopping.is_set():
            try:
                with psycopg.connect(self.db.conninfo, autocommit=True) as conn:
                    conn.execute(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(self.db.notify_channel)))
                    self.listening.set()
                    retry_delay = 0.5
                    # A reconnect may have missed notifications: wake everyone once.
                    self.wakeup.fire()
                    while not self.stopping.is_set():
                        for note in conn.notifies(timeout=0.5, stop_after=1):
                            if note.payload.startswith("cancel:"):
                                # a running job asked to stop (dispatch/cancels.py), not new work
                                target = parse_notification(note.payload)
                                if target is not None and self.on_cancel is not None:
                                    self.on_cancel(*target)
                                continue
                            if note.payload == "interactive" and self.on_interactive is not None:
                                self.on_interactive()
                            self.wakeup.fire()
            except psycopg.Error as exc:
                self.listening.clear()
                log.warning("listener lost its connection (%s); retrying", str(exc).strip()[:200])
                self.stopping.wait(retry_delay)
                retry_delay = min(retry_delay * 2, 10.0)
