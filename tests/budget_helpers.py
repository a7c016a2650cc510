"""Helpers for the memory-budget tests: a recompute-cost counter and held bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat._policy.op_cost import op_cost
from remat._replay.checks import arg_shapes

#: The budgets the issue asks for.
FRACTIONS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)


class RecomputeCost(TorchDispatchMode):
    """Sum the planner's cost estimate over the ops a recompute runs (replayed ops do not run)."""

    def __init__(self) -> None:
        super().__init__()
        self.cost = 0
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        # Dead ops' stand-ins are meta tensors (NOTE [ Record and replay ] rule 5): free.
        stand_in = any(isinstance(t, torch.Tensor) and t.is_meta for t in outs)
        if remat.is_recomputing() and func is not torch.ops.aten.detach.default and not stand_in:
            shapes = [(t.shape, t.dtype) for t in outs if isinstance(t, torch.Tensor)]
            self.cost += op_cost(func, arg_shapes(args, kwargs), shapes)
            self.ops += not func.is_view
        return out


def held_bytes(fn: Callable[..., Any], *args: Any, policy: Any) -> int:
    """Bytes the policy keeps for backward beyond inputs and parameters (saved_residuals)."""
    return remat.residual_totals(remat.saved_residuals(fn, *args, policy=policy))["saved"]


def recompute_cost(step: Callable[..., torch.Tensor], *args: Any) -> RecomputeCost:
    """Run ``step(*args).backward()``, counting what the backward recomputes."""
    loss = step(*args)
    with RecomputeCost() as counter:
        loss.backward()
    return counter
