"""docs/cli.md and docs/configuration.md are generated from the code (the
click commands, the Settings class); the committed files must be what the
code generates now."""

from __future__ import annotations

from tenantq.cli import docs
from tests.conftest import ROOT


def test_the_generated_reference_docs_are_up_to_date() -> None:
    for path, text in docs.generated(ROOT / "docs").items():
        assert path.exists() and path.read_text() == text, \
            f"{path.relative_to(ROOT)} is out of date: run `{docs.REGENERATE}` in the checkout and commit it"


def test_every_setting_and_every_visible_command_is_documented() -> None:
    from tenantq.cli import cli
    from tenantq.settings import Settings

    configuration = (ROOT / "docs" / "configuration.md").read_text()
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias if isinstance(field.validation_alias, str) else None
        assert f"`{alias or 'TENANTQ_' + name.upper()}`" in configuration, name
    reference = (ROOT / "docs" / "cli.md").read_text()
    for name, command in cli.commands.items():
        assert (f"## `tenantq {name}`" in reference) != command.hidden, name
    assert "## `tenantq jobs cancel`" not in reference  # the deprecated spellings are hidden
    readme = (ROOT / "README.md").read_text()
    assert "docs/configuration.md" in readme and "docs/cli.md" in readme
