"""A region returning several views of one output, one written in place after it.

``return h, h.t(), tanh(h)`` then ``b.mul_(3)``: without remat and in the eager
engine ``b`` is a view of ``h`` and the write reaches ``h``; the torch.func
engine's Function returned both as its outputs, and torch raised "Output 1 of
_RematFunction is a view ... multiple views". Now the view is made again outside
the Function (``_engines/functional/views.py``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import RecomputeCounter, assert_recomputed

import remat

POLICIES = ("nothing-saveable", "dots-saveable", "save-last")
torch.manual_seed(0)
W1 = torch.randn(8, 16, dtype=torch.double, requires_grad=True)
X = torch.randn(4, 8, dtype=torch.double)


def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = x @ W1
    return h, h.t(), torch.tanh(h)


def _run(region: object, write: str) -> tuple[torch.Tensor, ...]:
    a, b, c = region(X)  # type: ignore[operator]
    if write == "view":
        b.mul_(3)
    elif write == "base":
        a.add_(1)
    seen = [torch.zeros(())]
    if write != "base":  # torch 2.13 itself crashes on a hook on a view whose base was written
        b.register_hook(seen.append)
    (a.pow(2).sum() + c.sum() + b[0].sum()).backward()
    assert W1.grad is not None
    grad = W1.grad.clone()
    W1.grad = None
    return grad, seen[-1], a.detach().clone(), b.detach().clone()


@pytest.mark.parametrize("write", ["view", "base", "none"])
@pytest.mark.parametrize("engine", ["eager", "functional"])
@pytest.mark.parametrize("policy", POLICIES)
def test_views_of_one_output_written_in_place(policy: str, engine: str, write: str) -> None:
    want = _run(f, write)
    counter = RecomputeCounter()
    with counter:
        got = _run(remat.remat(f, policy=policy, engine=engine), write)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)

    def everything() -> object:
        with RecomputeCounter() as c:
            _run(remat.remat(f, engine=engine), write)
        return c.counts

    if write == "none":
        assert_recomputed(policy, counter.counts, everything)  # type: ignore[arg-type]
    elif policy != "save-last":  # a written output is no saved value: its op runs again
        assert counter.counts["tanh"] == 1 and counter.counts["mm"] == 1, counter.counts
