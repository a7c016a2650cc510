"""Memory budgets under ``torch.compile``: a region follows its eager plan inside the compiled
graph (NOTE [ Lowering under torch.compile ] rule 11)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from test_budget import block, block_inputs

import remat
from remat._engines.budget_plans import plan_key, plans_of

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from compiled import Capture, saved

pytestmark = [
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
]


def _compiled(region, xs):  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    capture = Capture()
    fn = torch.compile(lambda *a: region(*a).sum(), backend=capture.backend, fullgraph=True)
    return torch.autograd.grad(fn(*xs), xs), capture


def test_a_planned_budget_lowers_and_saves_within_its_plan() -> None:
    xs = block_inputs()
    want = torch.autograd.grad(block(*xs).sum(), xs)
    compiled_bytes = []
    for fraction in (0.0, 0.3, 0.5, 0.7, 1.0):
        region = remat.remat(block, policy=f"budget:{fraction}")
        torch.autograd.grad(region(*xs).sum(), xs)  # an eager call makes the plan
        # Other tests plan `block` for other inputs: look this plan up by its signature.
        home = region.__remat_region__
        plan = plans_of(home)[plan_key(home, xs, "eager")]
        got, capture = _compiled(region, xs)
        torch.testing.assert_close(got, want)
        (forward,) = capture.forward  # one graph: the region is in it, no graph break
        nbytes, _ = saved(forward, 1)
        # The compiled graph saves what the eager plan holds, byte for byte (a kept
        # view as its base op: the same storage).
        assert nbytes == plan.held_bytes <= plan.budget_bytes
        compiled_bytes.append(nbytes)
    assert compiled_bytes[0] == 0 < compiled_bytes[1]
    assert compiled_bytes == sorted(compiled_bytes)


def test_compiled_before_any_plan_warns_and_the_fix_works() -> None:
    def unplanned(*a: torch.Tensor) -> torch.Tensor:  # a function no plan was made for
        return block(*a)

    xs = block_inputs()
    want = torch.autograd.grad(block(*xs).sum(), xs)
    region = remat.remat(unplanned, policy="budget:0.45")
    where = r"unplanned \(.*test_budget_lowering.py:\d+\)"
    with pytest.warns(remat.RematWarning, match=where + ".*no eager call"):
        got, capture = _compiled(region, xs)
    torch.testing.assert_close(got, want)
    assert saved(capture.forward[0], 1)[0] == 0  # kept nothing: within every budget
    # The fix the warning names: one eager call, then compile again.
    torch.autograd.grad(region(*xs).sum(), xs)
    got, capture = _compiled(region, xs)
    torch.testing.assert_close(got, want)
    assert saved(capture.forward[0], 1)[0] > 0


def test_other_shapes_than_the_plans_warn() -> None:
    def other(*a: torch.Tensor) -> torch.Tensor:
        return block(*a)

    region = remat.remat(other, policy="budget:0.55")
    small, large = block_inputs(seq=6), block_inputs(seq=10)
    torch.autograd.grad(region(*small).sum(), small)  # plans for seq 6 only
    want = torch.autograd.grad(block(*large).sum(), large)
    with pytest.warns(remat.RematWarning, match="does not match the traced ops at op #0"):
        got, capture = _compiled(region, large)
    torch.testing.assert_close(got, want)
    assert saved(capture.forward[0], 1)[0] == 0
