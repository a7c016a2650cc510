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

def _with_views(x: Any, table: dict[int, torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return table.get(id(x), x)
    if type(x) is tuple:
        return tuple(_with_views(v, table) for v in x)
    return x


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
    if any(isinstance(x, (list, tuple, dict)) for x in flat):
        return None
    return flat

def _outer_views(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``tensors`` as the innermost running substitution maps them (a nested region)."""
    if not local.substitutions:
        return tensors
    table = local.substitutions[-1].table
    return tuple(table.get(id(t), t) for t in tensors)


def args_with(
    args: tuple[Any, ...], tensor_args: list[tuple[int, Any]], table: dict[int, torch.Tensor]
) -> tuple[Any, ...]:
    """The user's arguments, a tensor argument itself replaced by its view.

    A tensor passed as an argument may go straight into a transform ``fn``
    runs itself (``torch.func.grad(g)(x)``), which no op substitution sees.
    Containers stay the user's own, so what ``fn`` does to them stays done.
    """
    if not tensor_args:
        return args
    new = list(args)
    for i, x in tensor_args:
        new[i] = table.get(id(x), x)
    return tuple(new)


def kwargs_with(
    kwargs: dict[str, Any], tensor_kwargs: list[tuple[str, Any]], table: dict[int, torch.Tensor]
) -> dict[str, Any]:
    """The user's keyword arguments, tensors (and tuples of them) replaced by their views."""
    if not tensor_kwargs:
        return kwargs
    return {**kwargs, **{k: _with_views(x, table) for k, x in tensor_kwargs}}
