"""Wrapper tensor subclasses (``_make_wrapper_subclass`` + ``__torch_dispatch__``).

Such a tensor has a storage without a data pointer (touching it raises "invalid
python storage"); remat's storage identity must not touch it. torch's testing
``TwoTensor`` is the simplest one: it unwraps, runs the op on both halves, and
rewraps.
"""

from __future__ import annotations

import pytest
import torch
from helpers import WIDE_POLICIES, OpCounter

import remat
from tests.conftest import Engine

two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
TwoTensor = two_tensor.TwoTensor

def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    return (torch.sin(h) @ w).sum()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(4, 3)
    return TwoTensor(a, torch.randn(4, 3)), torch.randn(3, 3)


def _assert_same(found: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    for got, want in zip(found, expected, strict=True):
        assert type(got) is type(want)
        if isinstance(want, TwoTensor):
            torch.testing.assert_close(got.a, want.a)
            torch.testing.assert_close(got.b, want.b)
        else:
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("policy", WIDE_POLICIES)
def test_wrapper_subclass_input(engine: Engine, policy: str) -> None:
    x, w = _inputs()
    expected = engine.grads(block, x, w)
    _assert_same(engine.grads(engine.remat(block, policy=policy), x, w), expected)


@pytest.mark.parametrize(("policy", "kept_mm"), [("dots-saveable", True),
                                                  ("nothing-saveable", False)])
def test_wrapper_subclass_recomputes_what_the_policy_drops(policy: str, kept_mm: bool) -> None:
    """What is recomputed: dots are replayed under dots-saveable, rerun under nothing-saveable."""
    x, w = _inputs()
    xs = (x.detach().requires_grad_(), w.detach().requires_grad_())

    def backward_counts(fn: object) -> OpCounter:
        out = fn(*xs)  # type: ignore[operator]
        with OpCounter() as counter:
            torch.autograd.grad(out, xs)
        return counter

    plain = backward_counts(block)
    rematted = backward_counts(remat.remat(block, policy=policy, engine="eager"))
    assert plain.counts["tanh"] == 0
    assert rematted.counts["tanh"] > 0  # tanh is recomputed under both policies
    if kept_mm:
        assert rematted.counts["mm"] == plain.counts["mm"]
    else:
        assert rematted.counts["mm"] > plain.counts["mm"]


def test_saved_residuals_of_a_wrapper_subclass() -> None:
    x, w = _inputs()
    residuals = remat.saved_residuals(block, x.requires_grad_(), w.requires_grad_(),
                                      policy="dots-saveable")
    decisions = {r.source: r.decision for r in residuals}
    assert decisions["argument x"] == "input" and decisions["argument w"] == "input"
    saved = [r for r in residuals if r.decision == remat.policies.Decision.SAVE]
    assert [r.op for r in saved] == [torch.ops.aten.mm.default], residuals
