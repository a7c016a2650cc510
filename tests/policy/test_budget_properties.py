"""Property test of memory budgets over random small programs: within budget, monotone, exact."""

from __future__ import annotations

import torch
from helpers import STEPS, held_bytes, recompute_cost, step_program
from hypothesis import given, settings
from hypothesis import strategies as st

import remat
from remat._engines.budget_plans import plans_of

#: Steps that branch: the program reads two earlier values (chains, several readers).
BRANCHES = ("skip", "gate")


def _graph(steps: list[str]):  # type: ignore[no-untyped-def]
    body = step_program([s for s in steps if s not in BRANCHES])

    def run(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        values = [h]
        for step in steps:
            if step == "skip":
                h = h + values[len(values) // 2]
            elif step == "gate":
                h = torch.tanh(h) * torch.sigmoid(values[-1] @ w)
            else:
                h = STEPS[step](h, w)
            values.append(h)
        return h

    return run if any(s in BRANCHES for s in steps) else body


@settings(deadline=None, max_examples=25)
@given(
    steps=st.lists(st.sampled_from(sorted([*STEPS, *BRANCHES])), min_size=1, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_random_programs_within_budget_and_monotone(steps: list[str], seed: int) -> None:
    fn = _graph(steps)
    torch.manual_seed(seed)
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(seed)
    expected = torch.autograd.grad((fn(x, w) ** 2).sum(), (x, w), allow_unused=True)
    costs = []
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        region = remat.remat(fn, policy=f"budget:{fraction}", engine="eager")
        torch.manual_seed(seed)
        got = torch.autograd.grad((region(x, w) ** 2).sum(), (x, w), allow_unused=True)
        for a, e in zip(got, expected, strict=True):
            assert (a is None) == (e is None)
            if e is not None:
                torch.testing.assert_close(a, e)
        (plan,) = plans_of(region.__remat_region__).values()
        assert plan.held_bytes <= plan.budget_bytes
        torch.manual_seed(seed)
        counted = recompute_cost(lambda x, w, r=region: (r(x, w) ** 2).sum(), x, w)
        assert counted.cost == plan.cost  # the planner's model is the engine's
        torch.manual_seed(seed)
        assert held_bytes(fn, x, w, policy=f"budget:{fraction}") == plan.held_bytes
        costs.append(plan.cost)
    assert costs == sorted(costs, reverse=True), costs
