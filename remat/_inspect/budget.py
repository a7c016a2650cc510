"""What a memory budget chooses: the plan of one call, made as the eager engine makes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import policies
from .._engines.budget_plans import BudgetPlan, plan_key, plans_of
from .._engines.eager import Frame
from .._engines.region import Region, describe_callable
from .._policy.budget import MemoryBudget

__all__ = ["budget_plan"]


def budget_plan(
    fn: Callable[..., Any], *args: Any, policy: policies.PolicyLike, **kwargs: Any
) -> BudgetPlan:
    """Plan ``fn(*args, **kwargs)`` under a memory budget and return the plan.

    Runs the forward once, eagerly, as the eager engine does on a region's first
    call with these input shapes. The plan prints as a table: each op's bytes and
    decision, with the budget, the predicted held bytes and the predicted
    recompute cost. `saved_residuals` with the same policy shows the residuals
    the plan keeps.

    Args:
        fn (callable): the function (or module) to plan.
        *args (Any): its positional arguments.
        policy (PolicyLike): a memory budget: ``"budget:0.3"``, ``"budget:64MiB"``
            or ``remat.policies.memory_budget(...)``.
        **kwargs (Any): its keyword arguments.

    Returns:
        BudgetPlan: the plan.

    Raises:
        TypeError: when ``policy`` is not a memory budget.

    Examples:
        >>> import torch, remat
        >>> w = torch.randn(16, 16, requires_grad=True)
        >>> def f(x):
        ...     return torch.tanh(torch.tanh(x @ w) @ w).sum()
        >>> plan = remat.budget_plan(f, torch.randn(8, 16), policy="budget:0.5")
        >>> # two (8, 16) tanh outputs: 1 KiB when everything is kept; half of it fits
        >>> plan.held_bytes <= plan.budget_bytes, plan.budget_bytes, plan.full_bytes
        (True, 512, 1024)
    """
    budget = policies.resolve(policy)
    if not isinstance(budget, MemoryBudget):
        raise TypeError(
            f"remat.budget_plan: policy={policy!r} is not a memory budget; "
            'pass one such as policy="budget:0.3" or remat.policies.memory_budget(0.3)'
        )
    region = Region(fn=fn, policy=budget, label=describe_callable(fn))
    frame = Frame(region, args, kwargs)
    with torch.enable_grad():
        key = plan_key(region, frame.inputs, "eager")
        out = frame.run_forward()  # plans, unless this signature's plan is made already
    del out
    return plans_of(region)[key]
