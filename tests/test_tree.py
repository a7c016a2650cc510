"""The test tree mirrors the package, and pytest can import every test file.

Tests live in one folder per feature (``tests/policy/`` for ``remat/_policy/``, ...),
with no ``__init__.py``: pytest's default import mode imports each test file by
its basename, so two files of the same name in different folders would collide
(and a folder named like a stdlib module, ``inspect``, would shadow it as a package).
"""

from __future__ import annotations

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "remat"


def test_test_files_have_unique_names() -> None:
    names = collections.Counter(p.name for p in TESTS.rglob("*.py"))
    clashes = sorted(name for name, n in names.items() if n > 1)
    assert not clashes, f"rename one of each: {clashes} (pytest imports test files by name)"


def test_no_test_folder_is_a_package() -> None:
    packages = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("__init__.py"))
    assert not packages, f"remove {packages}: test folders are not packages (see the docstring)"


def test_every_sub_package_has_a_folder_of_tests() -> None:
    sub_packages = {p.parent.name.removeprefix("_") for p in PACKAGE.glob("_*/__init__.py")}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    missing = sorted(sub_packages - folders)
    assert not missing, f"add tests/{missing[0]}/ for remat/_{missing[0]}/"
