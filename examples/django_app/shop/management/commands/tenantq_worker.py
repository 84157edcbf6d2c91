"""`python manage.py tenantq_worker [OPTIONS]`: `tenantq worker` inside this
project. Django is set up first (the handlers use the ORM); the database is
the project's (settings.DATABASE_URL) unless TENANTQ_DATABASE_URL is set;
--app defaults to settings.TENANTQ_APP. Every `tenantq worker` option is
accepted (`python manage.py tenantq_worker --help` lists them)."""

import os
import sys
from typing import Any

import click
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, handle_default_options
from django.db import connections

import tenantq
from tenantq.cli_worker import worker


class Command(BaseCommand):
    help = "Run tenantq's worker on this project's database (takes every `tenantq worker` option)."
    # call_command("tenantq_worker", worker_args=["--once"])
    stealth_options = ("worker_args",)

    def run_from_argv(self, argv: list[str]) -> None:
        # Django's own options (--settings, --verbosity, ...) are Django's, the
        # rest are the worker's; --help is the worker's
        parser = self.create_parser(argv[0], argv[1], add_help=False, allow_abbrev=False)
        options, worker_args = parser.parse_known_args(argv[2:])
        handle_default_options(options)
        try:
            self.execute(**vars(options), worker_args=worker_args)
        except CommandError as exc:
            self.stderr.write(f"error: {exc}")
            sys.exit(exc.returncode)
        finally:
            connections.close_all()

    def handle(self, *args: Any, worker_args: list[str] | tuple[str, ...] = (), **options: Any) -> None:
        os.environ.setdefault("TENANTQ_DATABASE_URL", settings.DATABASE_URL)
        argv = list(worker_args)
        if not any(arg == "--app" or arg.startswith("--app=") for arg in argv):
            argv = ["--app", settings.TENANTQ_APP, *argv]
        try:
            worker.main(args=argv, prog_name="manage.py tenantq_worker", standalone_mode=False)
        except click.ClickException as exc:
            raise CommandError(exc.format_message()) from None
        except tenantq.TenantqError as exc:
            raise CommandError(str(exc)) from None
