"""docs/using-from-your-app.md cannot drift from tested code: every ```python
block starts with a comment naming the example file it comes from
(`# examples/...py`), and the rest of the block is in that file verbatim,
as contiguous lines (indented alike, when it was cut out of a function).
The example files themselves run in tests/examples/test_*.py."""

from __future__ import annotations

import re
import textwrap

import pytest

from tests.conftest import ROOT

DOC = ROOT / "docs" / "using-from-your-app.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SOURCE = re.compile(r"# (examples/[\w./-]+\.py)\n")
LANGUAGES = ("python", "bash")


def blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(DOC.read_text())]


def python_blocks() -> list[str]:
    return [text for language, text in blocks() if language == "python"]


def contains(source: str, body: str) -> bool:
    """`body`'s lines appear in `source` as whole, contiguous lines, all
    indented by the same prefix (blank lines may be empty)."""
    lines = source.splitlines()
    wanted = body.splitlines()
    for indent in sorted({line[: len(line) - len(line.lstrip())] for line in lines}, key=len):
        shifted = [textwrap.indent(w, indent) if w.strip() else "" for w in wanted]
        for start in range(len(lines) - len(shifted) + 1):
            window = lines[start:start + len(shifted)]
            if all(have.rstrip() == want.rstrip() for have, want in zip(window, shifted, strict=True)):
                return True
    return False


def test_the_page_has_only_blocks_this_test_knows() -> None:
    found = blocks()
    assert len(python_blocks()) >= 10, "the page lost its examples"
    for language, text in found:
        assert language in LANGUAGES, f"a ```{language} block: teach this test about it\n{text}"


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.splitlines()[0][2:] if b else "empty")
def test_every_python_block_is_code_from_the_example_it_names(block: str) -> None:
    header = SOURCE.match(block)
    assert header, f"a python block must start with `# examples/PATH.py` (where it comes from):\n{block}"
    path = ROOT / header.group(1)
    assert path.is_file(), f"{header.group(1)} does not exist"
    body = block[header.end():]
    assert body.strip(), f"an empty block from {header.group(1)}"
    assert contains(path.read_text(), body), (
        f"this block is not in {header.group(1)} verbatim: copy it from there again\n{body}")


def test_contains_matches_whole_indented_lines_only() -> None:
    source = "def f():\n    a = 1\n\n    b = 2\n"
    assert contains(source, "a = 1\n\nb = 2\n")
    assert contains(source, "    a = 1\n")
    assert not contains(source, "a = 1\nb = 2\n")  # not contiguous
    assert not contains(source, "a = \n")  # not a whole line
    assert not contains(source, "a = 1\n  b = 2\n")  # indented differently
