"""`python manage.py tenantq_migrate`: `tenantq migrate` on the project's
database (TENANTQ_DATABASE_URL when it is set, else DATABASES["default"];
schema TENANTQ_SCHEMA, default `tenantq`). Idempotent, safe to run
concurrently: run it next to `manage.py migrate`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError  # type: ignore[import-untyped]

from tenantq.contrib.django import database_url
from tenantq.errors import TenantqError
from tenantq.queue import Queue


class Command(BaseCommand):  # type: ignore[misc]
    help = "Create or upgrade tenantq's tables in this project's database (`tenantq migrate`)."
    requires_system_checks: list[str] = []

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            with Queue(database_url()) as queue:
                self.stdout.write(queue.migrate().summary())
        except TenantqError as exc:
            raise CommandError(str(exc)) from None
