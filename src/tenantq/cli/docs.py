"""The generated reference docs: docs/cli.md from the click commands (every
command and option, with its help) and docs/configuration.md from the
Settings class (every TENANTQ_* variable, its default and description).

    python -m tenantq.cli.docs            # rewrite both (run from the checkout)
    python -m tenantq.cli.docs --check    # exit 1 if either is out of date

tests/docs/test_generated_docs.py fails when the committed files differ."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import click

REGENERATE = "python -m tenantq.cli.docs"
WIDTH = 100


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _paragraphs(help_text: str) -> list[str]:
    """A command's help as markdown: its paragraphs, and click's \\b blocks as code."""
    out: list[str] = []
    for paragraph in inspect.cleandoc(help_text).split("\n\n"):
        if paragraph.startswith("\b\n"):
            out += ["```", *(line.rstrip() for line in paragraph[2:].splitlines()), "```", ""]
        elif paragraph.strip():
            out += [" ".join(paragraph.split()), ""]
    return out


def _commands(command: click.Command, parent: click.Context | None, name: str) -> list[str]:
    ctx = click.Context(command, info_name=name, parent=parent, terminal_width=WIDTH,
                        max_content_width=WIDTH)
    path = ctx.command_path
    out = [f"## `{path}`", "", "```", f"{path} {' '.join(command.collect_usage_pieces(ctx))}".rstrip(),
           "```", ""]
    out += _paragraphs(command.help or "")
    rows = [record for param in command.get_params(ctx)
            if isinstance(param, click.Option) and (record := param.get_help_record(ctx))]
    arguments = [p.human_readable_name for p in command.params if isinstance(p, click.Argument)]
    if arguments:
        out += [f"Arguments: {', '.join(f'`{a}`' for a in arguments)}.", ""]
    if rows:
        out += ["| option | what it does |", "|---|---|"]
        out += [f"| `{_cell(opts)}` | {_cell(text)} |" for opts, text in rows]
        out.append("")
    if isinstance(command, click.Group):
        for sub_name in command.list_commands(ctx):
            sub = command.get_command(ctx, sub_name)
            if sub is not None and not sub.hidden:
                out += _commands(sub, ctx, sub_name)
    return out


def cli_markdown() -> str:
    from tenantq.cli import cli

    lines = ["# The command line", "",
             f"Generated from the click commands by `{REGENERATE}`: do not edit by hand.",
             "`tenantq COMMAND --help` prints the same. The code is in `src/tenantq/cli/`.", ""]
    return "\n".join(lines + _commands(cli, None, "tenantq")).rstrip() + "\n"


def _default(field: Any) -> str:
    if field.default_factory is not None:
        doc = (field.default_factory.__doc__ or "computed").strip().splitlines()[0]
        return _cell(doc)
    if field.default is None:
        return "unset"
    if field.default == "":
        return "empty"
    return f"`{field.default}`"


def configuration_markdown() -> str:
    from tenantq.settings import Settings

    lines = ["# Configuration", "",
             f"Generated from `tenantq.settings.Settings` by `{REGENERATE}`: do not edit by hand.",
             "Every setting is an environment variable; a `tenantq` option that sets the same thing wins.",
             "", "| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias if isinstance(field.validation_alias, str) else None
        variable = alias or f"TENANTQ_{name.upper()}"
        lines.append(f"| `{variable}` | {_default(field)} | {_cell(field.description or '')} |")
    for path, option in _option_envvars():
        lines.append(f"| `{option.envvar}` | unset | The default of `{path} {option.opts[0]}`: "
                     f"{_cell(option.help or '')} |")
    return "\n".join(lines) + "\n"


def _option_envvars() -> list[tuple[str, click.Option]]:
    """Options that read a variable of their own (click's envvar), not a setting."""
    from tenantq.cli import cli

    found: list[tuple[str, click.Option]] = []

    def walk(command: click.Command, path: str) -> None:
        found.extend((path, p) for p in command.params if isinstance(p, click.Option) and p.envvar)
        if isinstance(command, click.Group):
            for name, sub in sorted(command.commands.items()):
                walk(sub, f"{path} {name}")

    walk(cli, "tenantq")
    return found


def generated(docs_dir: Path) -> dict[Path, str]:
    return {docs_dir / "cli.md": cli_markdown(), docs_dir / "configuration.md": configuration_markdown()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    docs_dir = Path("docs")
    stale = [path for path, text in generated(docs_dir).items()
             if not path.exists() or path.read_text() != text]
    if "--check" in args:
        for path in stale:
            print(f"{path} is out of date: run `{REGENERATE}`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in generated(docs_dir).items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
