"""An output the region returns detached (``h.detach()``) does not require grad, as without remat.

The torch.func engine's Function made every floating output require grad (bug:
``hd.requires_grad=True`` and a ``grad_fn``; gradients were right). Now it marks
such outputs non-differentiable (NOTE [ What the backward gives back ] rule 3).
"""

from __future__ import annotations

import pytest
import torch
from helpers import RecomputeCounter, assert_recomputed

import remat

POLICIES = ("nothing-saveable", "dots-saveable", "save-last")
torch.manual_seed(0)
W1 = torch.randn(8, 16, dtype=torch.double, requires_grad=True)
W2 = torch.randn(16, 8, dtype=torch.double, requires_grad=True)
X = torch.randn(4, 8, dtype=torch.double)


def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.tanh(x @ w1)
    return h @ w2, h.detach()


def _backward(region: object) -> tuple[bool, tuple[torch.Tensor, ...]]:
    y, hd = region(X, W1, W2)  # type: ignore[operator]
    return hd.requires_grad, torch.autograd.grad((y.sum() * hd.sum()), [W1, W2])


@pytest.mark.parametrize("engine", ["eager", "functional"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_detached_output_does_not_require_grad(engine: str, policy: str) -> None:
    want_flag, want = _backward(f)
    assert want_flag is False
    counter = RecomputeCounter()
    with counter:
        flag, got = _backward(remat.remat(f, policy=policy, engine=engine))
    assert flag is False
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)

    def everything() -> object:
        with RecomputeCounter() as c:
            _backward(remat.remat(f, engine=engine))
        return c.counts

    assert_recomputed(policy, counter.counts, everything)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", POLICIES)
def test_under_transforms_the_detached_output_carries_nothing(policy: str) -> None:
    region = remat.remat(f, policy=policy)
    args = (X, W1.detach(), W2.detach())

    def loss(fn: object, w1: torch.Tensor) -> torch.Tensor:
        y, hd = fn(X, w1, args[2])  # type: ignore[operator]
        return y.sum() * hd.sum()

    want = torch.func.grad(lambda w: loss(f, w))(args[1])
    torch.testing.assert_close(torch.func.grad(lambda w: loss(region, w))(args[1]), want)
    tangent = torch.ones_like(args[1])
    _, want_t = torch.func.jvp(lambda w: f(X, w, args[2]), (args[1],), (tangent,))
    _, got_t = torch.func.jvp(lambda w: region(X, w, args[2]), (args[1],), (tangent,))
    for g, w in zip(got_t, want_t, strict=True):
        torch.testing.assert_close(g, w)
    batched = torch.stack([args[1], 2 * args[1]])
    want_v = torch.func.vmap(torch.func.grad(lambda w: loss(f, w)))(batched)
    got_v = torch.func.vmap(torch.func.grad(lambda w: loss(region, w)))(batched)
    torch.testing.assert_close(got_v, want_v)
