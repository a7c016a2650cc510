"""The docs site builds strictly, and every Python block in docs/*.md runs."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SKIP = "<!-- skip -->"
#: A fenced python block (possibly indented, as inside content tabs) and what precedes it.
BLOCK = re.compile(
    r"(?P<before>[^\n]*\n)?(?P<indent>[ \t]*)```python\n(?P<code>.*?)\n(?P=indent)```", re.S
)


def python_blocks(page: pathlib.Path) -> list[tuple[int, str, bool]]:
    """(line, code, skipped) for every ```python block of ``page``."""
    text = page.read_text()
    blocks = []
    for match in BLOCK.finditer(text):
        indent = match["indent"]
        code = "\n".join(line.removeprefix(indent) for line in match["code"].splitlines())
        skipped = SKIP in (match["before"] or "")
        line = text.count("\n", 0, match.start("code"))
        blocks.append((line, code, skipped))
    return blocks


PAGES = sorted(DOCS.glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_python_blocks_run(page: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for line, code, skipped in python_blocks(page):
        if not skipped:  # blocks of one page share a namespace, as a reader's session would
            exec(compile("\n" * line + code, str(page), "exec"), namespace)


def test_skip_markers_are_counted() -> None:
    skipped = {p.name: sum(s for _, _, s in python_blocks(p)) for p in PAGES}
    # Only the CUDA host-store example is skipped: it needs a GPU.
    assert {name for name, n in skipped.items() if n} <= {"offload.md"}


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="pip install remat[docs]")
def test_mkdocs_build_strict(tmp_path: pathlib.Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    start = api.index('id="remat.remat"')
    remat_section = api[start : api.index('id="remat.checkpoint_name"')]
    assert "-&gt; Callable[[F], F]" not in remat_section  # no overload rendered
