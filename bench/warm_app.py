"""The warm-start benchmark's app: a warmup that imports several heavy
standard-library and third-party modules (what a real handler needs before
its first job), and handlers that use them."""

from __future__ import annotations

import time
from typing import Any

import tenantq

MODULES: dict[str, Any] = {}


@tenantq.warmup
def import_heavy_modules() -> None:
    import asyncio
    import decimal
    import email.parser
    import http.client
    import json
    import sqlite3
    import urllib.request
    import xml.etree.ElementTree

    import jinja2
    import numpy
    import pydantic
    import rich.console

    MODULES.update(asyncio=asyncio, decimal=decimal, email=email.parser, http=http.client, json=json,
                   sqlite3=sqlite3, urllib=urllib.request, xml=xml.etree.ElementTree, jinja2=jinja2,
                   numpy=numpy, pydantic=pydantic, rich=rich.console)


@tenantq.handler("warmbench.noop", timeout=10, memory_mb=256)
def noop(payload: Any, ctx: tenantq.JobContext) -> int:
    return len(MODULES)


@tenantq.handler("warmbench.sleep10", timeout=10, memory_mb=256)
def sleep10(payload: Any, ctx: tenantq.JobContext) -> int:
    """10 ms of work that touches the warmed modules."""
    template = MODULES["jinja2"].Template("{{ n }}")
    time.sleep(0.01)
    return int(template.render(n=len(MODULES)))


@tenantq.handler("warmbench.sleep10_shared", timeout=10, memory_mb=256, process="batch")
def sleep10_shared(payload: Any, ctx: tenantq.JobContext) -> int:
    """The same, with process="batch": jobs of a batch share one process."""
    return sleep10(payload, ctx)


@tenantq.handler("warmbench.sleep200", timeout=10, memory_mb=256)
def sleep200(payload: Any, ctx: tenantq.JobContext) -> int:
    """200 ms of work that touches the warmed modules (bench/per_job.py)."""
    template = MODULES["jinja2"].Template("{{ n }}")
    time.sleep(0.2)
    return int(template.render(n=len(MODULES)))
