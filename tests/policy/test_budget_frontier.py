"""Memory budgets past the exact solver (NOTE [ The budget planner ] rule 4): above the
MILP's size or node limit a plan comes from one frontier per program, so the recompute
cost never grows with the budget there either, whatever order budgets are planned in."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import recompute_cost
from test_budget import block, block_inputs

import remat
from remat._engines import budget_plans
from remat._engines.budget_plans import plans_of
from remat._policy import planner
from remat.policies import memory_budget


def _plans(sizes: list[int], xs: tuple[torch.Tensor, ...]) -> list[remat.BudgetPlan]:
    out = []
    for size in sizes:
        fresh = lambda *a: block(*a)  # noqa: E731 - another function: no cached plan
        out.append(remat.budget_plan(fresh, *xs, policy=memory_budget(bytes=size)))
    return out


@pytest.mark.parametrize("limit", ["size", "nodes"])
def test_above_the_exact_solver_plans_are_monotone_and_order_free(
    monkeypatch: pytest.MonkeyPatch, limit: str
) -> None:
    if limit == "size":
        monkeypatch.setattr(planner, "EXACT_LIMIT", 0)  # every region is "large"
    else:
        monkeypatch.setattr(planner, "NODE_LIMIT", 0)  # HiGHS stops before branching
    xs = block_inputs()
    full = remat.budget_plan(block, *xs, policy="budget:1").full_bytes
    sizes = sorted({full * k // 40 for k in range(40)} | {full - 1})
    planner._frontier.cache_clear()
    up = _plans(sizes, xs)
    planner._frontier.cache_clear()
    down = _plans(sizes[::-1], xs)[::-1]  # the other order: the same plans
    assert [(p.kept, p.cost) for p in up] == [(p.kept, p.cost) for p in down]
    approximate = [p for p in up if p.solver == "frontier of fixed budgets"]
    assert len(approximate) > len(sizes) // 2, [p.solver for p in up]
    costs = [p.cost for p in up]
    assert costs == sorted(costs, reverse=True), costs
    assert costs[0] > costs[-1]  # the curve moves: budgets buy recompute back
    for plan, size in zip(up, sizes, strict=True):
        assert plan.held_bytes <= plan.budget_bytes == size


def test_a_frontier_plan_is_what_the_engine_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner, "EXACT_LIMIT", 0)
    xs = block_inputs()
    x = torch.randn_like(xs[0], requires_grad=True)
    want = torch.autograd.grad(block(x, *xs[1:]).sum(), x)
    for fraction in (0.2, 0.5, 0.8):
        fresh = lambda *a: block(*a)  # noqa: E731 - another function: no cached plan
        region = remat.remat(fresh, policy=f"budget:{fraction}", engine="eager")

        def step(x: torch.Tensor, r=region) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return r(x, *xs[1:]).sum()

        recompute_cost(step, x)  # plans
        (plan,) = plans_of(region.__remat_region__).values()
        assert plan.solver == "frontier of fixed budgets"
        assert recompute_cost(step, x).cost == plan.cost
        torch.testing.assert_close(torch.autograd.grad(step(x), x), want)


def test_the_frontier_is_a_pareto_front(monkeypatch: pytest.MonkeyPatch) -> None:
    xs = block_inputs()
    program = _program(xs, monkeypatch)
    front = planner.frontier(program).plans
    assert front[0].held_bytes == 0  # keeping nothing is on it
    pairs = itertools.pairwise(front)
    assert all(a.held_bytes < b.held_bytes and a.cost > b.cost for a, b in pairs)
    exact = planner.solve(program, program.full_bytes() // 2)
    assert planner.frontier(program).best(program.full_bytes() // 2).cost >= exact.cost


def _program(xs: tuple[torch.Tensor, ...], monkeypatch: pytest.MonkeyPatch) -> planner.Program:
    """The program the eager engine plans ``block`` from (recorded keeping everything)."""
    seen: list[planner.Program] = []

    def spy(program: planner.Program, budget: int) -> planner.Outcome:
        seen.append(program)
        return planner.solve(program, budget)

    monkeypatch.setattr(budget_plans, "solve", spy)
    fresh = lambda *a: block(*a)  # noqa: E731 - another function: no cached plan
    remat.budget_plan(fresh, *xs, policy="budget:0.5")
    monkeypatch.undo()
    (program,) = seen
    return program
