"""How the torch.func engine hands a call's arguments to ``fn``.

NOTE [ The functional engine ] rules 2 and 11 (in ``__init__.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._state import local


def _handed_over(x: Any) -> bool:
    """Whether an argument is handed to ``fn`` as the Function's view.

    NOTE [ The functional engine ] rule 2.

    A tensor, or a plain tuple holding tensors (``remat.sequential``'s activations):
    a tuple cannot be mutated, so rebuilding it loses no side effect. Lists, dicts
    and objects stay the user's own, and op substitution covers their tensors.
    """
    if isinstance(x, torch.Tensor):
        return True
    return type(x) is tuple and any(_handed_over(v) for v in x)

class Released:
    """Stands in a call's arguments for a tensor it let go of after its forward.

    NOTE [ The functional engine ] rule 13. Each recompute's substitution table
    maps the stand-in (by identity, as it mapped the tensor) to the input.
    """

    __slots__ = ()


def _with_views(x: Any, table: dict[int, torch.Tensor]) -> Any:
    if isinstance(x, (torch.Tensor, Released)):
        return table.get(id(x), x)
    if type(x) is tuple:
        return tuple(_with_views(v, table) for v in x)
    return x


class Arguments:
    """The user's own arguments of one call (NOTE [ The functional engine ] rule 2).

    ``fn`` runs on them, not on copies; a tensor argument itself (or a plain
    tuple of them) is handed over as the Function's view, since it may go
    straight into a transform ``fn`` runs itself (``torch.func.grad(g)(x)``),
    which no op substitution sees. Containers stay the user's own, so what
    ``fn`` does to them stays done.
    """

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs
        #: Positions of the arguments (and keyword names) handed over.
        self.handed = [i for i, x in enumerate(args) if _handed_over(x)]
        self.handed_kw = [k for k, x in kwargs.items() if _handed_over(x)]

    def with_views(self, table: dict[int, torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments ``fn`` gets: each handed-over tensor replaced by its view."""
        args, kwargs = self.args, self.kwargs
        if self.handed:
            new = list(args)
            for i in self.handed:
                new[i] = _with_views(new[i], table)
            args = tuple(new)
        if self.handed_kw:
            kwargs = {**kwargs, **{k: _with_views(kwargs[k], table) for k in self.handed_kw}}
        return args, kwargs

    def let_go(self, originals: tuple[Any, ...]) -> tuple[Any, ...]:
        """Hold no handed-over tensor any more; ``originals`` with `Released` stand-ins.

        NOTE [ The functional engine ] rule 13. A tensor that ``originals`` holds
        twice (an argument ``fn`` also closes over, tied arguments) stays: its
        one entry in the substitution table serves both.
        """
        counts: dict[int, int] = {}
        for t in originals:
            counts[id(t)] = counts.get(id(t), 0) + 1
        stand_ins: dict[int, Released] = {}

        def swap(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and counts.get(id(x)) == 1:
                return stand_ins.setdefault(id(x), Released())
            if type(x) is tuple:
                return tuple(swap(v) for v in x)
            return x

        if self.handed:
            new = list(self.args)
            for i in self.handed:
                new[i] = swap(new[i])
            self.args = tuple(new)
        if self.handed_kw:
            self.kwargs = {**self.kwargs, **{k: swap(self.kwargs[k]) for k in self.handed_kw}}
        return tuple(stand_ins.get(id(t), t) for t in originals)


def _argument_objects(leaves: Sequence[Any], label: str) -> list[tuple[Any, str]]:
    """Argument leaves that are objects no flattening sees into.

    NOTE [ The functional engine ] rule 2.
    """
    return [
        (leaf, f"argument object {type(leaf).__qualname__} of {label}")
        for leaf in leaves
        if not isinstance(leaf, (torch.Tensor, *_PLAIN_VALUES))
    ]

_PLAIN_VALUES = (str, bytes, int, float, complex, bool, torch.dtype, torch.device)

def _unpartial(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    # A partial's bound arguments cannot be swapped in place; make them call arguments.
    while isinstance(fn, functools.partial):
        args = (*fn.args, *args)
        kwargs = {**fn.keywords, **kwargs}
        fn = fn.func
    return fn, args, kwargs

def _flat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
    """An op's arguments as one list when none is a container (most ops), else None."""
    flat = [*args, *kwargs.values()]
    for x in flat:  # a loop, not any(): this runs for every op
        if isinstance(x, _CONTAINERS):
            return None
    return flat


_CONTAINERS = (list, tuple, dict)

def _outer_views(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``tensors`` as the innermost running substitution maps them (a nested region)."""
    if not local.substitutions:
        return tensors
    table = local.substitutions[-1].table
    return tuple(table.get(id(t), t) for t in tensors)

