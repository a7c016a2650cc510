"""What a user checks before adopting remat: license, changelog, API docs, CLI help, examples."""

from __future__ import annotations

import pathlib
import re
import types

import remat
import remat.compat
import remat.policies
import remat.testing
from remat import __main__ as cli
from remat.integrations import huggingface

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_license_is_the_full_apache_text_pyproject_names() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    for section in ("1. Definitions.", "4. Redistribution.", "9. Accepting Warranty",
                    "END OF TERMS AND CONDITIONS"):
        assert section in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()


def test_the_changelog_has_every_version() -> None:
    version = re.findall(r'^version = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M)[0]
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings == ["Unreleased", version] and remat.__version__ == version


def test_the_api_reference_renders_every_public_name_once() -> None:
    page = (ROOT / "docs" / "api.md").read_text()
    rendered = re.findall(r"^::: (\S+)$", page, flags=re.M)
    assert len(rendered) == len(set(rendered))
    modules = {n for n in remat.__all__ if isinstance(getattr(remat, n), types.ModuleType)}
    expected = {f"remat.{n}" for n in remat.__all__ if n not in modules} - {"remat.checkpoint"}
    for module in (remat.policies, remat.testing, remat.compat, huggingface):
        expected |= {f"{module.__name__}.{n}" for n in module.__all__}
    expected.add("remat.testing")  # its module docstring: what the doubles are for
    assert set(rendered) == expected
    assert "`remat.checkpoint` is `remat.remat`" in page


def test_overloads_are_rendered_once() -> None:
    # mkdocstrings would render each @overload's signature below the function's.
    assert "show_overloads: false" in (ROOT / "mkdocs.yml").read_text()


def test_the_cli_help_says_what_each_option_does() -> None:
    parser = cli._parser()
    options = [a for a in parser._actions if a.option_strings != ["-h", "--help"]]
    assert {a.dest for a in options} == {"depth", "width", "heads", "batch", "seq", "repeats",
                                         "threads"}
    text = parser.format_help()
    for action in options:
        assert action.help and len(action.help) > 15, action.dest
        assert action.help.split()[0] in text
    assert "(default: 8)" in text and "Example: python -m remat" in text


def test_the_readme_lists_every_example() -> None:
    readme = (ROOT / "README.md").read_text()
    for script in sorted((ROOT / "examples").glob("*.py")):
        assert f"(examples/{script.name})" in readme, script.name
