"""What a region's function closes over: its closure cells and the leaves they reach.

NOTE [ State the forward changes ] rules 2 and 3 (``_capture/module_state.py``).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import Any

import torch

from .slots import has_grad_slot

__all__ = ["closed_over_leaves", "closure_cells", "holds_plain", "is_bound"]

_PLAIN_TYPES = (int, float, complex, bool, str, bytes, type(None))


def is_bound(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def holds_plain(cell: types.CellType) -> bool:
    """Whether ``cell`` holds a plain Python value (rule 2 restores those only)."""
    return is_bound(cell) and type(cell.cell_contents) in _PLAIN_TYPES


def closure_cells(fn: Any) -> list[types.CellType]:
    """The closure cells of ``fn`` (a function, bound method or partial) and of
    the functions it closes over, one level down (a ``nonlocal`` helper)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, types.FunctionType):
        return []
    cells = list(fn.__closure__ or ())
    known = {id(c) for c in cells}  # by identity: cells compare by their contents
    for cell in list(cells):
        inner = cell.cell_contents if is_bound(cell) else None
        if isinstance(inner, types.FunctionType):
            for c in inner.__closure__ or ():
                if id(c) not in known:
                    known.add(id(c))
                    cells.append(c)
    return cells


def closed_over_leaves(fn: Any, cells: Iterable[types.CellType]) -> list[torch.Tensor]:
    """Leaf tensors requiring grad in ``fn``'s cells, defaults and named globals (rule 3)."""
    values = [cell.cell_contents for cell in cells if is_bound(cell)]
    target = getattr(fn, "__func__", fn)
    if isinstance(target, types.FunctionType):
        values.extend(target.__defaults__ or ())
        scope = target.__globals__
        values.extend(scope[name] for name in target.__code__.co_names if name in scope)
    leaves: list[torch.Tensor] = []
    for value in values:
        if has_grad_slot(value) and all(value is not t for t in leaves):
            leaves.append(value)
    return leaves
