"""``torch.autograd.grad`` inside a region with respect to a tensor from outside it.

A region's graph starts at its arguments: the recompute (eager engine) runs on
detached arguments, and the torch.func engine's Function sees only its inputs.
So when ``fn`` differentiates with respect to a tensor that reaches it only
through an argument computed outside the region (``p = x0 * 2`` outside,
``torch.autograd.grad(e, x0)`` inside), that path does not exist where remat runs
``fn``: torch says the tensor "appears to not have been used in the graph", or,
with ``allow_unused=True``, returns None and the recompute differs from the
forward. `GradWatch` finds such calls and raises `RematError` naming the cause.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._errors import RematError

__all__ = ["GradWatch", "OutsideGradError", "differentiated_by", "feeds", "outside_grad_error"]

#: How many autograd nodes `feeds` visits at most (a whole model's graph is fine).
_MAX_NODES = 1_000_000


def differentiated_by(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The tensors a ``torch.autograd.grad`` call differentiates with respect to (else [])."""
    if func is not torch.autograd.grad:
        return []
    inputs = kwargs["inputs"] if "inputs" in kwargs else args[1] if len(args) > 1 else ()
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    return [t for t in inputs if isinstance(t, torch.Tensor)]


def feeds(source: torch.Tensor, targets: Iterable[torch.Tensor]) -> bool:
    """Whether ``source`` is an autograd ancestor of one of ``targets`` (plain tensors)."""
    node = source.grad_fn
    roots: list[Any] = [t.grad_fn for t in targets if t.grad_fn is not None]
    seen: set[int] = set()
    while roots and len(seen) < _MAX_NODES:
        current = roots.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if current is node or (node is None and getattr(current, "variable", None) is source):
            return True
        roots.extend(next_node for next_node, _ in current.next_functions)
    return False


class OutsideGradError(RematError):
    """``fn`` differentiates with respect to a tensor the region cannot reach."""


def outside_grad_error(label: str, t: torch.Tensor) -> OutsideGradError:
    return OutsideGradError(
        f"remat: {label} calls torch.autograd.grad with respect to a tensor of shape "
        f"{tuple(t.shape)} that reaches the region only through an argument computed from "
        "it outside the region. The region's graph starts at its arguments (its recompute "
        "runs on them detached), so that path does not exist there: the gradient would be "
        "missing. Use policy='everything-saveable' for this region (it then runs as plain "
        "autograd); or, under loss.backward() with engine='eager', pass the tensor you "
        "differentiate by as the argument and compute the rest inside the region."
    )


class GradWatch(TorchFunctionMode):
    """Raise `outside_grad_error` before a ``torch.autograd.grad`` that ``check`` flags."""

    def __init__(self, label: str, check: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()
        self.label = label
        self.check = check

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for t in differentiated_by(func, tuple(args), kwargs):
            if self.check(t):
                raise outside_grad_error(self.label, t)
        return func(*args, **kwargs)
