"""`python manage.py tenantq_worker [OPTIONS]`: `tenantq worker` inside a
Django project. Django is set up first (inline handlers may use the ORM);
the database is TENANTQ_DATABASE_URL when it is set, else Django's
`DATABASES["default"]`; `--app` defaults to `settings.TENANTQ_APP`. Every
`tenantq worker` option is passed through (`--help` lists them); Django's
own (`--settings`, `--pythonpath`, `--verbosity`, `--traceback`,
`--skip-checks`) are Django's.

    call_command("tenantq_worker", "--once", "--sandbox", "inline")
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from django.conf import settings  # type: ignore[import-untyped]
from django.core.management.base import (  # type: ignore[import-untyped]
    BaseCommand,
    CommandError,
    CommandParser,
    handle_default_options,
)
from django.db import connections  # type: ignore[import-untyped]
from pydantic import ValidationError

from tenantq.contrib.django import database_url
from tenantq.errors import TenantqError


class _PassThroughParser(CommandParser):  # type: ignore[misc]
    """Django's options are Django's; every other argument is the worker's
    (in `worker_args`, in order), also when given to call_command."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        options, rest = self.parse_known_args(args, namespace)
        options.worker_args = [*(getattr(options, "worker_args", None) or ()), *rest]
        return options


class Command(BaseCommand):  # type: ignore[misc]
    help = "Run tenantq's worker with Django set up (takes every `tenantq worker` option)."
    # call_command("tenantq_worker", worker_args=["--once"]) works too
    stealth_options = ("worker_args",)

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        # --help is the worker's; no abbreviations (--set is not --settings)
        parser = super().create_parser(prog_name, subcommand, add_help=False, allow_abbrev=False, **kwargs)
        parser.__class__ = _PassThroughParser  # the same parser, which keeps what it does not know
        return parser

    def print_help(self, prog_name: str, subcommand: str) -> None:  # `manage.py help tenantq_worker`
        self.stdout.write(_worker_help(_prog(prog_name, subcommand)))

    def run_from_argv(self, argv: list[str]) -> None:
        # Django's, but an error is one line `error: ...` as with `tenantq worker`
        self._called_from_command_line = True
        self._prog = _prog(argv[0], argv[1])
        options = self.create_parser(argv[0], argv[1]).parse_args(argv[2:])
        handle_default_options(options)
        try:
            self.execute(**vars(options))
        except CommandError as exc:
            if options.traceback:
                raise
            self.stderr.write(f"error: {exc}")
            sys.exit(exc.returncode)
        finally:
            connections.close_all()

    def handle(self, *args: Any, worker_args: list[str] | tuple[str, ...] = (), **options: Any) -> None:
        argv = [*args, *worker_args]
        if "--help" in argv:
            self.stdout.write(_worker_help(getattr(self, "_prog", "manage.py tenantq_worker")))
            return
        if not any(arg == "--app" or arg.startswith("--app=") for arg in argv):
            app = getattr(settings, "TENANTQ_APP", None)
            if not app:
                raise CommandError("--app MODULE is missing: pass it, or set TENANTQ_APP in the settings")
            argv = ["--app", app, *argv]
        try:
            with _tenantq_database():
                _cli().main(args=["worker", *argv], prog_name="tenantq", standalone_mode=False)
        except click.Abort:
            raise CommandError("aborted", returncode=130) from None
        except click.ClickException as exc:
            raise CommandError(exc.format_message(), returncode=exc.exit_code) from None
        except TenantqError as exc:
            raise CommandError(str(exc)) from None
        except ValidationError as exc:  # a TENANTQ_* variable that does not parse
            raise CommandError(str(exc).strip()) from None


def _prog(prog_name: str, subcommand: str) -> str:
    name = os.path.basename(prog_name)
    return f"{'python -m django' if name == '__main__.py' else name} {subcommand}"


def _cli() -> click.Group:
    from tenantq.cli import cli

    return cli


def _worker_help(prog: str) -> str:
    """The worker's --help, with this command's name in its usage line."""
    group = _cli()
    with click.Context(group, info_name="tenantq") as ctx:
        worker = group.get_command(ctx, "worker")
        assert worker is not None, "tenantq's CLI has no worker command"
        with click.Context(worker, info_name=prog) as sub:
            return worker.get_help(sub)


@contextmanager
def _tenantq_database() -> Iterator[None]:
    """TENANTQ_DATABASE_URL for the worker, while it runs: as it is when
    set, else Django's default database."""
    if os.environ.get("TENANTQ_DATABASE_URL"):
        yield
        return
    os.environ["TENANTQ_DATABASE_URL"] = database_url()
    try:
        yield
    finally:
        os.environ.pop("TENANTQ_DATABASE_URL", None)
