"""Nested regions, both on the torch.func engine, under ``loss.backward()``.

The inner region's forward (an op-tracing policy) runs under ``torch.func.vjp``
inside the outer one's forward, where eager autograd records it: its outputs
require grad, made there, not hidden inputs; and its bookkeeping (storage
addresses, output bases) is remat's own work, not calls of the outer function.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from tests.helpers import RecomputeCounter


class _Layer(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(torch.tanh(self.lin(x)))
        return out


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))


def _grads(inner: str | None, outer: str | None, p: float) -> list[torch.Tensor]:
    torch.manual_seed(1)
    model = nn.Sequential(_Layer(p), nn.Sequential(_Layer(p), _Layer(p)))
    if inner is not None and outer is not None:
        remat.wrap(model[1][0], policy=inner, engine="functional")
        remat.wrap(model[1], policy=outer, engine="functional")
    torch.manual_seed(3)
    (model(X) ** 2).sum().backward()
    return [q.grad for q in model.parameters()]  # type: ignore[misc]


@pytest.mark.parametrize("p", [0.0, 0.4])
@pytest.mark.parametrize("inner", ["dots-saveable", "save-last", "budget:0.3"])
@pytest.mark.parametrize("outer", ["nothing-saveable", "dots-saveable"])
def test_an_op_tracing_region_inside_another_gets_no_remats_gradients(
    outer: str, inner: str, p: float
) -> None:
    expected = _grads(None, None, p)
    with RecomputeCounter() as counter:
        got = _grads(inner, outer, p)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert counter.counts["tanh"] > 0, counter.counts  # the outer region recomputes
