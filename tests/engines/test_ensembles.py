"""torch.func's model-ensembling recipe with a rematerialized base module.

``stack_module_state`` stacks the models' parameters and buffers; ``vmap`` over
``functional_call`` on a ``meta`` copy of one model runs them all at once, under
``torch.func.grad``. The base copy's slots then hold the caller's batched
tensors while the vmap rule's twin runs (NOTE [ The functional engine ] rule
10); the state guard's reads of them are remat's work, not the function's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

import remat
from tests.helpers import RecomputeCounter


class _Member(nn.Module):
    def __init__(self, scaled: bool) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 12)
        self.l2 = nn.Linear(12, 6)
        if scaled:
            self.register_buffer("scale", torch.tensor(1.5))
        self.scaled = scaled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.l2(torch.tanh(self.l1(x)))
        return out * self.scale if self.scaled else out


X = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))


def _ensemble_grads(base: nn.Module, members: list[nn.Module]) -> dict[str, torch.Tensor]:
    params, buffers = stack_module_state(members)  # type: ignore[arg-type]

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        run = vmap(lambda p, b: functional_call(base, (p, b), (X,)))
        out: torch.Tensor = run(p, buffers)
        return out.pow(2).sum()

    grads: dict[str, torch.Tensor] = grad(loss)(params)
    return grads


@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_an_ensemble_over_a_rematerialized_base_gets_no_remats_gradients(
    policy: str, scaled: bool
) -> None:
    torch.manual_seed(0)
    members: list[nn.Module] = [_Member(scaled) for _ in range(3)]
    expected = _ensemble_grads(copy.deepcopy(members[0]).to("meta"), members)
    base = remat.wrap(copy.deepcopy(members[0]).to("meta"), policy=policy)
    with RecomputeCounter() as counter:
        got = _ensemble_grads(base, members)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    recomputed = sum(counter.counts.values())
    if policy == "save-last":
        assert recomputed == 0, counter.counts  # the only region: its forward is kept
    else:
        assert counter.counts["tanh"] > 0, counter.counts
        dots = counter.counts["addmm"] + counter.counts["mm"] + counter.counts["bmm"]
        assert (dots == 0) == (policy == "dots-saveable"), counter.counts
