"""Log output: structured JSON lines for machines, text for people, and a
live one-line progress view when the worker is attached to a terminal."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(log_format: str | None, *, level: int = logging.INFO) -> str:
    """Set up the root logger; `None` picks text on a terminal, else json."""
    chosen = log_format or ("text" if sys.stderr.isatty() else "json")
    handler: logging.Handler
    if chosen == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
    elif sys.stderr.isatty():
        # through the same console as the progress line, so log lines print
        # above it instead of through it
        from rich.logging import RichHandler

        handler = RichHandler(console=terminal(), show_path=False, markup=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return chosen


_CONSOLE: Any = None


def terminal() -> Any:
    """The one rich Console on stderr shared by log lines and the progress line."""
    global _CONSOLE
    if _CONSOLE is None:
        from rich.console import Console

        _CONSOLE = Console(stderr=True)
    return _CONSOLE


class ProgressLine(threading.Thread):
    """Redraws one status line on the terminal every half second. It clears
    itself when the worker stops: the command prints the final stats once,
    as its last line."""

    def __init__(self, render: Callable[[], str], stopping: threading.Event) -> None:
        super().__init__(name="tenantq-progress", daemon=True)
        self.render = render
        self.stopping = stopping

    def run(self) -> None:
        from rich.live import Live
        from rich.text import Text

        with Live(Text(self.render()), console=terminal(), refresh_per_second=2, transient=True) as live:
            while not self.stopping.wait(0.5):
                live.update(Text(self.render()))
