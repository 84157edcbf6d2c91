"""Named SQL blocks loaded from the `.sql` files beside this module.

Each file holds the statements of one noun (jobs, batches, queues, ...); a
block starts with `-- name: <block>` and runs to the next marker. Comments in
the files say why each statement looks the way it does.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import LiteralString

from psycopg.sql import SQL, Composed, Identifier

_MARKER = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_FRAGMENT = re.compile(r"\{[a-z_]+\}")


def parse_blocks(text: str) -> dict[str, str]:
    """Split a file into {name: sql}; text before the first marker is ignored."""
    parts = _MARKER.split(text)
    blocks: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in blocks:
            raise ValueError(f"duplicate SQL block {name!r}")
        blocks[name] = body.strip().rstrip(";").strip()
    return blocks


@cache
def _file_blocks(noun: str) -> dict[str, str]:
    text = resources.files("tenantq.store").joinpath("sql").joinpath(f"{noun}.sql").read_text()
    return {name: _without_comment_lines(body) for name, body in parse_blocks(text).items()}


def _without_comment_lines(body: str) -> str:
    """The statement as sent: without its whole-line comments (the files are
    where they are read). Shorter is faster: psycopg caches the conversion of
    a query's %(name)s placeholders only for statements of at most 4,096
    bytes (its MAX_CACHED_STATEMENT_LENGTH), and `insert` and `settle` were
    longer with their comments, so each call parsed them again."""
    return "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("--"))


def sql(noun: str, name: str) -> LiteralString:
    """The statement `name` from `sql/<noun>.sql`.

    Typed LiteralString for psycopg: the text comes from files shipped in the
    package, never from input (mypy treats LiteralString as str).
    """
    text = _block(noun, name)
    if "{" in text and "}" in text and ("{schema}" in text or _FRAGMENT.search(text)):
        raise KeyError(f"SQL block {name!r} in {noun}.sql has placeholders: use qualified() or composed()")
    return text


@cache
def qualified(noun: str, name: str, schema: str) -> LiteralString:
    """The statement `name` with `{schema}` replaced by the quoted schema.

    For statements that also run on a caller's connection (enqueue inside
    the caller's transaction), whose search_path is the caller's: their
    names are qualified instead of relying on search_path, which tenantq
    never changes on a connection it does not own. Rendered once, to text
    (a Composed would be joined again on every execute)."""
    return _rendered(SQL(_block(noun, name)).format(schema=Identifier(schema)))


@cache
def composed(noun: str, name: str, **fragments: str) -> LiteralString:
    """The statement `name` with each `{fragment}` replaced by the block of
    that name in the same file (one text for what two statements share)."""
    fills = {k: SQL(_block(noun, v)) for k, v in fragments.items()}
    return _rendered(SQL(_block(noun, name)).format(**fills))


def _rendered(statement: Composed) -> LiteralString:
    # the pieces are the package's SQL files and a quoted identifier
    return statement.as_string()


def _block(noun: str, name: str) -> LiteralString:
    blocks = _file_blocks(noun)
    try:
        return blocks[name]
    except KeyError:
        raise KeyError(f"no SQL block {name!r} in {noun}.sql") from None


def schema_sql() -> LiteralString:
    return resources.files("tenantq.store").joinpath("sql").joinpath("schema.sql").read_text()


def migration_files() -> list[tuple[int, str, LiteralString]]:
    """(version, name, sql) for every numbered migration, in order."""
    folder = resources.files("tenantq.store").joinpath("sql").joinpath("migrations")
    found: list[tuple[int, str, LiteralString]] = []
    for entry in folder.iterdir():
        match = re.match(r"^(\d{4})_([a-z0-9_]+)\.sql$", entry.name)
        if match:
            found.append((int(match[1]), match[2], entry.read_text()))
    found.sort()
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations must be numbered 0001.. without gaps, found {versions}")
    return found
