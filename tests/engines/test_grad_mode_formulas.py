"""Backward formulas that differ by grad mode (``silu``, ``mish``, ``group_norm``).

``torch.func.grad`` runs its backward under grad mode, ``loss.backward()``
without: a few formulas round otherwise (``functional/formulas.py``). The
torch.func engine's backward follows the caller's grad mode where the
recompute has such an op, so its gradients are no remat's bit for bit, in
float32 too; elsewhere it keeps the backward without a graph.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from tests.helpers import RecomputeCounter

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "mish": F.mish,
    "group_norm": lambda h: F.group_norm(h.reshape(6, 4, 4), 2).reshape(6, 16),
}


class _Block(nn.Module):
    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 8)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.l2(self.act(self.l1(x))) + x
        return out


X = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))


def _model(name: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(ACTIVATIONS[name]), _Block(ACTIVATIONS[name]))


def _func_grad(model: nn.Module) -> dict[str, torch.Tensor]:
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = torch.func.functional_call(model, p, (X,))
        return out.pow(2).sum()

    grads: dict[str, torch.Tensor] = torch.func.grad(loss)(params)
    return grads


def _backward(model: nn.Module) -> dict[str, torch.Tensor]:
    model(X).pow(2).sum().backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
@pytest.mark.parametrize("how", ["torch.func.grad", "loss.backward"])
def test_formulas_follow_the_callers_grad_mode(how: str, policy: str, name: str) -> None:
    run = _func_grad if how == "torch.func.grad" else _backward
    expected = run(_model(name))
    model = _model(name)
    remat.apply(model, where=_Block, policy=policy, engine="functional")
    with RecomputeCounter() as counter:
        got = run(model)
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), (k, (got[k] - expected[k]).abs().max())
    assert sum(counter.counts.values()) > 0, counter.counts  # the first block recomputes


def test_the_two_forms_differ_so_the_test_can_fail() -> None:
    h = torch.randn(64, 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    g = torch.randn(64, 64, generator=torch.Generator().manual_seed(6))
    plain = torch.autograd.grad(F.silu(h), h, g)[0]
    graphed = torch.autograd.grad(F.silu(h), h, g, create_graph=True)[0]
    assert not torch.equal(plain, graphed.detach())
