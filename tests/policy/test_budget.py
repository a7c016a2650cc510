"""Memory budgets (``policy="budget:0.3"``): held bytes within the budget, recompute cost
optimal and monotone, gradients exact, in both engines (DESIGN §1 "memory budgets")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    FRACTIONS,
    PROGRAMS,
    LoRALinear,
    assert_close_all,
    held_bytes,
    recompute_cost,
    tiny_bert_encoder,
)

import remat
from remat._engines.budget_plans import plans_of
from remat.policies import Decision, memory_budget


def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """A transformer-ish block: matmuls, a norm, activations, a residual; one named value."""
    h = F.layer_norm(x, (x.shape[-1],))
    a = remat.checkpoint_name(torch.tanh(h @ w1), "hidden")
    b = F.gelu(a @ w2) * torch.sigmoid(a)
    scores = torch.softmax(b @ b.transpose(-1, -2), dim=-1)
    return x + (scores @ b) @ w3


def block_inputs(batch: int = 2, seq: int = 6, width: int = 8) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    x = torch.randn(batch, seq, width, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(width, width, dtype=torch.float64, requires_grad=True) / 3 for _ in range(3)]
    return (x, *[w.detach().requires_grad_() for w in ws])


def loss_of(fn, policy, **options):  # type: ignore[no-untyped-def]
    region = remat.remat(fn, policy=policy, **options)
    return region, (lambda *xs: region(*xs).sum())


def only_plan(region, engine="eager"):  # type: ignore[no-untyped-def]
    """The one plan the region's engine made (regions over one function share plans)."""
    (plan,) = [p for p in plans_of(region.__remat_region__).values() if p.engine == engine]
    return plan


# -- grammar -------------------------------------------------------------------


def test_strings_and_factory() -> None:
    assert remat.policies.resolve("budget:0.3") == memory_budget(0.3)
    assert remat.policies.resolve("budget:64MiB") == memory_budget(bytes=64 << 20)
    assert remat.policies.resolve("budget: 1.5KiB") == memory_budget(bytes=1536)
    assert remat.policies.resolve("budget:2GiB") == memory_budget(bytes=2 << 30)
    assert remat.policies.resolve("budget:100B") == memory_budget(bytes=100)
    assert remat.policies.resolve("budget:1") == memory_budget(1.0)


@pytest.mark.parametrize(
    "text", ["budget:1.5", "budget:-0.1", "budget:abc", "budget:", "budget:5MB"]
)
def test_invalid_budget_strings_raise_at_decoration(text: str) -> None:
    with pytest.raises(ValueError, match="budget"):
        remat.remat(torch.sin, policy=text)


def test_invalid_factory_arguments() -> None:
    with pytest.raises(ValueError, match="from 0 to 1"):
        memory_budget(1.5)
    with pytest.raises(ValueError, match="not both"):
        memory_budget(0.5, bytes=10)
    with pytest.raises(ValueError, match="not both"):
        memory_budget()
    with pytest.raises(ValueError, match="int >= 0"):
        memory_budget(bytes=-1)
    with pytest.raises(TypeError, match="number"):
        memory_budget("0.3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"memory_budget\(0.3\)"):
        remat.remat(torch.sin, policy=memory_budget)


# -- the eager engine: exact bytes and costs -------------------------------------


def _check_budget(fn, xs, policy):  # type: ignore[no-untyped-def]
    """One budget on ``fn``: plan within budget, engine holds and recomputes what it predicted."""
    region, step = loss_of(fn, policy, engine="eager")
    first = recompute_cost(step, *xs)  # the first call plans (NOTE [ Budget plans ] rule 2)
    plan = only_plan(region)
    second = recompute_cost(step, *xs)  # a later call decides by the plan
    assert plan.held_bytes <= plan.budget_bytes or plan.held_bytes == 0
    assert held_bytes(fn, *xs, policy=policy) == plan.held_bytes
    assert first.cost == second.cost == plan.cost
    return plan, second


@pytest.mark.parametrize("name", ["block", *PROGRAMS])
def test_held_within_budget_and_cost_monotone(name: str) -> None:
    if name == "block":
        fn, xs = block, block_inputs()
    else:
        fn, xs = PROGRAMS[name][0], PROGRAMS[name][1]()
    costs = []
    for fraction in FRACTIONS:
        plan, _ = _check_budget(fn, xs, f"budget:{fraction}")
        assert plan.held_bytes <= plan.budget_bytes
        costs.append(plan.cost)
    assert costs == sorted(costs, reverse=True), costs
    full = held_bytes(fn, *xs, policy="everything-saveable")
    if name == "dropout":
        # Random ops are never kept (replaying one would shift the random stream):
        # budget:1 recomputes dropout's mask, which plain autograd holds.
        assert plan.full_bytes < full
    else:  # the fraction's base is what everything-saveable holds
        assert plan.full_bytes == full
    # Absolute sizes: within the budget too.
    for size in (0, full // 3, full // 2, full, 10 * full):
        plan, _ = _check_budget(fn, xs, memory_budget(bytes=size))
        assert plan.held_bytes <= size


def test_budget_0_is_nothing_saveable_and_1_is_everything_saveable() -> None:
    xs = block_inputs()
    for budget, hand in (("budget:0", "nothing-saveable"), ("budget:1", "everything-saveable")):
        _, budget_step = loss_of(block, budget, engine="eager")
        _, hand_step = loss_of(block, hand, engine="eager")
        recompute_cost(budget_step, *xs)  # plans
        assert held_bytes(block, *xs, policy=budget) == held_bytes(block, *xs, policy=hand)
        ours, theirs = recompute_cost(budget_step, *xs), recompute_cost(hand_step, *xs)
        assert (ours.ops, ours.cost) == (theirs.ops, theirs.cost)
        assert held_bytes(block, *xs, policy=budget) == (
            0 if hand == "nothing-saveable" else held_bytes(block, *xs, policy=hand)
        )
    assert recompute_cost(loss_of(block, "budget:1", engine="eager")[1], *xs).ops == 0


@pytest.mark.parametrize("hand", ["dots-saveable", "dots-no-batch-saveable", "save:hidden"])
def test_at_a_hand_policys_memory_the_budget_recomputes_no_more(hand: str) -> None:
    xs = block_inputs()
    theirs = recompute_cost(loss_of(block, hand, engine="eager")[1], *xs)
    their_bytes = held_bytes(block, *xs, policy=hand)
    plan, ours = _check_budget(block, xs, memory_budget(bytes=their_bytes))
    assert plan.held_bytes <= their_bytes
    assert ours.cost <= theirs.cost
    assert plan.full_cost > ours.cost  # it does keep something at that size


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7, 1.0])
def test_gradients_equal_the_reference(engine, fraction: float) -> None:  # type: ignore[no-untyped-def]
    xs = block_inputs()
    region = engine.remat(block, policy=f"budget:{fraction}")

    def f(*a: torch.Tensor) -> torch.Tensor:
        return region(*a).sum()

    expected = torch.autograd.grad(block(*xs).sum(), xs)
    assert_close_all(engine.grads(f, *xs), expected)  # the first call plans
    assert_close_all(engine.grads(f, *xs), expected)  # a later call follows the plan
    plan = only_plan(region, engine.name)
    assert plan.held_bytes <= plan.budget_bytes


def test_torch_func_engine_budget_ends() -> None:
    """torch.func engine: budget:0 keeps nothing, budget:1 keeps every op output."""
    xs = block_inputs()
    for fraction, kept in ((0.0, 0), (1.0, None)):
        region = remat.remat(block, policy=f"budget:{fraction}")
        torch.func.grad(lambda *a, r=region: r(*a).sum(), argnums=(0, 1))(*xs)
        plan = only_plan(region, "functional")
        assert plan.held_bytes == (0 if kept == 0 else plan.full_bytes)
        if kept == 0:
            assert plan.kept == frozenset() and plan.cost == plan.full_cost


def test_vmap_of_grad() -> None:
    xs = block_inputs()
    batch = torch.randn(3, *xs[0].shape, dtype=torch.float64)
    region = remat.remat(block, policy="budget:0.4")

    def per_example(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        return region(x, *ws).sum()

    def reference(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        return block(x, *ws).sum()

    dims = (0, None, None, None)
    got = torch.func.vmap(torch.func.grad(per_example), in_dims=dims)(batch, *xs[1:])
    want = torch.func.vmap(torch.func.grad(reference), in_dims=dims)(batch, *xs[1:])
    torch.testing.assert_close(got, want)
    for plan in plans_of(region.__remat_region__).values():
        assert plan.held_bytes <= plan.budget_bytes


def test_a_new_input_shape_gets_its_own_plan() -> None:
    region, step = loss_of(block, "budget:0.3", engine="eager")
    small, large = block_inputs(seq=6), block_inputs(seq=10)
    recompute_cost(step, *small)
    recompute_cost(step, *large)
    plans = [p for p in plans_of(region.__remat_region__).values() if p.engine == "eager"]
    assert len(plans) == 2 and plans[0].full_bytes < plans[1].full_bytes
    for plan, xs in zip(plans, (small, large), strict=True):
        assert plan.held_bytes <= plan.budget_bytes
        assert held_bytes(block, *xs, policy="budget:0.3") == plan.held_bytes
    # Each shape keeps following its own plan.
    assert recompute_cost(step, *small).cost == plans[0].cost
    assert recompute_cost(step, *large).cost == plans[1].cost


def test_a_call_whose_ops_differ_from_the_plan_keeps_nothing_then_replans() -> None:
    def branchy(x: torch.Tensor, w: torch.Tensor, twice: bool) -> torch.Tensor:
        h = torch.tanh(x @ w)
        if twice:  # the same tensor signature, other ops
            h = torch.tanh(h @ w)
        return (h @ w).exp()

    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    region = remat.remat(branchy, policy="budget:0.6", engine="eager")
    plans = plans_of(region.__remat_region__)
    for twice, held in ((False, None), (True, 0), (True, None)):
        def step(x: torch.Tensor, w: torch.Tensor, twice: bool = twice) -> torch.Tensor:
            return region(x, w, twice).sum()

        want = torch.autograd.grad(branchy(x, w, twice).sum(), (x, w))
        x.grad = w.grad = None
        report = remat.measure_memory(step, x, w)  # one call, its backward fills .grad
        assert x.grad is not None and w.grad is not None
        assert_close_all((x.grad, w.grad), want)
        if held == 0:  # diverged from the plan: kept nothing, and planned again next call
            assert plans == {}
            plain = remat.remat(branchy, policy="nothing-saveable", engine="eager")
            assert report.held_bytes == remat.measure_memory(
                lambda x, w, p=plain, t=twice: p(x, w, t).sum(), x, w
            ).held_bytes
        else:
            (plan,) = plans.values()
            assert len(plan.ops) == (6 if twice else 4), plan.ops
            assert 0 < plan.held_bytes <= plan.budget_bytes


# -- never more than no remat ------------------------------------------------------


def _plain_held(fn, x) -> int:  # type: ignore[no-untyped-def]
    return remat.measure_memory(lambda x: fn(x).sum(), x).held_bytes


def test_lora_stack_never_holds_more_than_no_remat() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[LoRALinear(32, 4) for _ in range(3)])
    x = torch.randn(8, 32)
    plain = _plain_held(model, x)
    dots = _plain_held(remat.remat(model, policy="dots-saveable", engine="eager"), x)
    assert dots > plain  # the finding: a hand policy can hold more than no remat
    for fraction in (0.0, 0.3, 0.7, 1.0):
        region = remat.remat(model, policy=f"budget:{fraction}", engine="eager")
        first = _plain_held(region, x)
        assert _plain_held(region, x) == first <= plain
    assert _plain_held(remat.remat(model, policy="budget:1", engine="eager"), x) == plain


def test_whole_bert_encoder_region_never_holds_more_than_no_remat() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_bert_encoder()
    x = torch.randn(2, 8, 32, requires_grad=True)

    def run(encoder):  # type: ignore[no-untyped-def]
        return lambda h: encoder(h).last_hidden_state

    plain = _plain_held(run(model), x)
    for fraction in (0.0, 0.5, 1.0):
        region = remat.remat(model, policy=f"budget:{fraction}", engine="eager")
        _plain_held(run(region), x)  # plans
        assert _plain_held(run(region), x) <= plain
        want = torch.autograd.grad(model(x).last_hidden_state.sum(), x)
        got = torch.autograd.grad(region(x).last_hidden_state.sum(), x)
        assert_close_all(got, want)


# -- modules, inspection, determinism ------------------------------------------------


def test_apply_and_sequential() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[LoRALinear(16, 2) for _ in range(3)])
    reference = torch.nn.Sequential(*[LoRALinear(16, 2) for _ in range(3)])
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 16, requires_grad=True)
    remat.apply(model, policy="budget:0.3", where=lambda name, m: isinstance(m, LoRALinear))
    for _ in range(2):
        trained = [p for p in model.parameters() if p.requires_grad]
        got = torch.autograd.grad(model(x).sum(), (x, *trained))
        trained = [p for p in reference.parameters() if p.requires_grad]
        want = torch.autograd.grad(reference(x).sum(), (x, *trained))
        assert_close_all(got, want)
    from remat._engines.budget_plans import _PLANS

    for layer in model:  # one plan per wrapped module, made once (its region is per call)
        (plans,) = _PLANS[layer].values()
        assert len(plans) == 1
    out = remat.sequential(list(reference), x, segments=3, policy="budget:0.5")
    assert_close_all(torch.autograd.grad(out.sum(), x), torch.autograd.grad(reference(x).sum(), x))


def test_saved_residuals_shows_each_decision_and_the_plan_matches() -> None:
    xs = block_inputs()
    plan = remat.budget_plan(block, *xs, policy=memory_budget(0.5))
    residuals = remat.saved_residuals(block, *xs, policy="budget:0.5")
    kept = [r for r in residuals if r.decision is Decision.SAVE]
    assert kept and {str(r.op) for r in kept} <= {str(plan.ops[i]) for i in plan.kept}
    assert remat.residual_totals(residuals)["saved"] == plan.held_bytes
    text = str(plan)
    assert "budget" in text and f"holds {plan.held_bytes} B" in text and "SAVE" in text


_PLAN_SCRIPT = """
import json, torch, remat
import sys; sys.path[:0] = ["tests", "tests/policy"]
from test_budget import block, block_inputs
plan = remat.budget_plan(block, *block_inputs(), policy="budget:0.3")
print(json.dumps([sorted(plan.kept), plan.held_bytes, plan.cost, [str(o) for o in plan.ops]]))
"""


def test_the_same_plan_in_two_processes() -> None:
    plan = remat.budget_plan(block, *block_inputs(), policy="budget:0.3")
    mine = [sorted(plan.kept), plan.held_bytes, plan.cost, [str(o) for o in plan.ops]]
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _PLAN_SCRIPT], capture_output=True, text=True, cwd=root,
        env={**__import__("os").environ, "PYTHONPATH": str(root)}, check=True,
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == mine


def test_tiny_llama_layers_under_budgets() -> None:
    """A plan that keeps attention but not its inputs: the recompute still matches
    (kept inputs reach SDPA as the held tensors, not meta stand-ins)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, use_cache=False,
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad(base(ids, labels=ids).loss, list(base.parameters()))
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    for fraction in (0.3, 0.7):
        import copy

        model = remat.apply(copy.deepcopy(base), policy=f"budget:{fraction}", where=layer)
        for _ in range(2):
            got = torch.autograd.grad(model(ids, labels=ids).loss, list(model.parameters()))
            assert_close_all(got, want)


def test_budget_plan_returns_a_budget_plan_and_refuses_other_policies() -> None:
    xs = block_inputs()
    plan = remat.budget_plan(block, *xs, policy="budget:0.5")
    assert isinstance(plan, remat.BudgetPlan)
    assert plan.held_bytes <= plan.budget_bytes < plan.full_bytes
    assert [plan.decision(i) is Decision.SAVE for i in range(len(plan.ops))] == [
        i in plan.kept for i in range(len(plan.ops))
    ]
    with pytest.raises(TypeError, match=r"remat.budget_plan: .*not a memory budget.*budget:0.3"):
        remat.budget_plan(block, *xs, policy="dots-saveable")
    # The fix the message gives works.
    assert isinstance(remat.budget_plan(block, *xs, policy="budget:0.3"), remat.BudgetPlan)


def test_a_plan_past_the_node_limit_still_fits_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from remat._policy import planner

    xs = block_inputs()
    exact = remat.budget_plan(block, *xs, policy="budget:0.4")
    monkeypatch.setattr(planner, "NODE_LIMIT", 0)
    fresh = lambda *a: block(*a)  # noqa: E731 - another function: no cached plan
    limited = remat.budget_plan(fresh, *xs, policy="budget:0.4")
    assert exact.solver == "exact (HiGHS MILP)"
    assert limited.solver == "frontier of fixed budgets", limited.solver
    assert limited.held_bytes <= limited.budget_bytes == exact.budget_bytes
    assert limited.cost >= exact.cost  # never better than the proven optimum
