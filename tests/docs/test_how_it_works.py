"""The contributors' map (docs/how-remat-works.md) names only files and NOTEs that exist."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "how-remat-works.md").read_text()


def test_every_note_the_page_names_exists() -> None:
    notes = {" ".join(n.split()) for n in re.findall(r"NOTE \[ ([^\]]+?) \]", PAGE)}
    source = "\n".join(p.read_text() for p in (ROOT / "remat").rglob("*.py"))
    defined = set(re.findall(r"^NOTE \[ ([^\]]+?) \]", source, flags=re.M))
    assert notes, "the page names no NOTE"
    assert notes <= defined, sorted(notes - defined)


def test_every_file_the_page_names_exists() -> None:
    paths = set(re.findall(r"`((?:_[a-z_]+/)+[a-z_]*\.py|_[a-z_]+/|[a-z_]+\.py)`", PAGE))
    paths |= set(re.findall(r"(_engines/[a-z_/]+\.py)", PAGE))
    missing = [p for p in paths if not ((ROOT / "remat" / p).exists() or (ROOT / p).exists())]
    exists_somewhere = {p for p in missing if list((ROOT / "remat").rglob(pathlib.Path(p).name))}
    assert not set(missing) - exists_somewhere, sorted(set(missing) - exists_somewhere)
    assert len(paths) > 10
