"""Per-thread state is one typed object with declared fields (NOTE [ Thread state ])."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch

import remat
from remat._capture.module_state import state_guard_of
from remat._capture.stateful import GuardsItsModules
from remat._offload.fake import FakeHostStore
from remat._offload.selection import current_store, use_host_store
from remat._state import ThreadState, local

PACKAGE = Path(__file__).resolve().parents[1] / "remat"


def _state_attributes(path: Path) -> set[str]:
    """The attributes read or written on the thread state (``local.X``) in ``path``."""
    return {
        node.attr
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "local"
    }


def test_every_field_used_is_declared() -> None:
    declared = set(vars(ThreadState()))
    used = {attr for path in PACKAGE.rglob("*.py") for attr in _state_attributes(path)}
    assert used <= declared, f"undeclared thread state: {sorted(used - declared)}"
    assert "__dict__" not in used  # no field added on the fly


def test_no_other_thread_local() -> None:
    others = [
        path.name
        for path in PACKAGE.rglob("*.py")
        if path.name != "_state.py" and "threading.local" in path.read_text()
    ]
    assert others == []


def test_fields_are_per_thread() -> None:
    store = FakeHostStore(min_bytes=0)
    seen: list[object] = []
    with use_host_store(store):
        assert current_store() is store and local.host_stores == [store]
        worker = threading.Thread(target=lambda: seen.append(list(local.host_stores)))
        worker.start()
        worker.join()
    assert seen == [[]] and local.host_stores == []


def test_a_wrapped_forward_guards_its_modules() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    wrapped = remat.wrap(model)
    forward = wrapped.forward
    assert isinstance(forward, GuardsItsModules)
    assert state_guard_of(forward).watch is False  # its own guard watches the modules

    def plain(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    plain.remat_guards_modules = True  # type: ignore[attr-defined]  # no duck typing
    assert not isinstance(plain, GuardsItsModules)
    assert state_guard_of(plain).watch is True


def test_internal_work_nests_unwinds_and_stays_on_its_thread() -> None:
    """`internal` and ``with INTERNAL:``, the one writer of ``internal_depth``, count alike."""
    from remat._state import INTERNAL, internal

    seen: list[int] = []
    with internal(), INTERNAL:
        assert local.internal_depth == 2
        worker = threading.Thread(target=lambda: seen.append(local.internal_depth))
        worker.start()
        worker.join()
    with pytest.raises(KeyError, match="inside"), INTERNAL:
        raise KeyError("inside")
    assert seen == [0] and local.internal_depth == 0
