"""tenantq in a Django project: add `"tenantq.contrib.django"` to
INSTALLED_APPS and it brings

- `manage.py tenantq_worker [OPTIONS]`: `tenantq worker` with Django set
  up (inline handlers may use the ORM), every `tenantq worker` option
  passed through, `--app` defaulting to `settings.TENANTQ_APP`;
- `manage.py tenantq_migrate`: `tenantq migrate` on the same database;
- `get_queue()`: the process's `tenantq.Queue` on that database, for
  `get_queue().enqueue(..., conn=django.db.connection)` in a view.

The database is TENANTQ_DATABASE_URL when it is set, else Django's own
`DATABASES["default"]` (NAME, USER, PASSWORD, HOST, PORT and the libpq
keys of OPTIONS) as a libpq DSN. The schema is TENANTQ_SCHEMA (default
`tenantq`)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tenantq.queue import Queue

__all__ = ["database_url", "django_dsn", "get_queue"]

_queues: dict[str, Queue] = {}
_lock = threading.Lock()


def django_dsn(using: str = "default") -> str:
    """`DATABASES[using]` as a libpq DSN: the parameters Django's
    PostgreSQL backend connects with, but those libpq does not know
    (OPTIONS such as `pool`, `isolation_level`, `server_side_binding`)."""
    from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
    from django.db import connections  # type: ignore[import-untyped]
    from psycopg import pq
    from psycopg.conninfo import make_conninfo

    wrapper = connections[using]
    if wrapper.vendor != "postgresql":
        raise ImproperlyConfigured(f"tenantq needs PostgreSQL: DATABASES[{using!r}] is "
                                   f"{wrapper.settings_dict['ENGINE']}")
    libpq_keys = {opt.keyword.decode() for opt in pq.Conninfo.get_defaults()}
    params = {key: value for key, value in wrapper.get_connection_params().items()
              if key in libpq_keys and value is not None and value != ""}
    return make_conninfo(**params)


def database_url(using: str = "default") -> str:
    """tenantq's database: TENANTQ_DATABASE_URL when it is set, else `django_dsn(using)`."""
    from tenantq.settings import Settings

    return Settings().database_url or django_dsn(using)


def get_queue(using: str = "default") -> Queue:
    """The process's `tenantq.Queue` on `database_url(using)` (one per
    alias, made at the first call; thread-safe). Its pool opens at the
    first statement that takes no `conn=`."""
    from tenantq.queue import Queue

    with _lock:
        queue = _queues.get(using)
        if queue is None:
            queue = _queues[using] = Queue(database_url(using))
        return queue
