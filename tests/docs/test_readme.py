"""The README's code runs as written, so it cannot rot."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README lost its tour"
    namespace: dict[str, object] = {}  # the tour's blocks build on each other
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)


def test_readme_names_the_commands_ci_runs() -> None:
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python -m pytest" in text and "python -m pytest" in ci
    assert "pip install torch==2.13.0" in text and "torch==2.13.0" in ci
    assert 'pip install -e ".[dev,docs]" && python -m pytest' in text
    assert '-e ".[dev,docs]"' in ci
    assert "python -m remat" in text
