"""Buffers passed into ``torch.func.grad(functional_call)`` and written in place by the region.

The torch.func way to train BatchNorm: the buffers are inputs of the transformed
function, so an op may update them in place there. Under remat they update once
(the forward), the recompute starts from the values the forward found, and the
gradients are those without remat.
"""

from __future__ import annotations

import pytest
import torch
from helpers import RecomputeCounter, assert_recomputed
from torch import nn
from torch.func import functional_call, grad

import remat

F64 = torch.float64
POLICIES = ("nothing-saveable", "dots-saveable", "save-last")


def _model() -> nn.Module:
    torch.manual_seed(1)
    block = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 8))
    return nn.Sequential(block).to(F64).train()


def _run(
    policy: str | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], nn.Module, RecomputeCounter]:
    """One ``grad(functional_call)`` step: gradients, the buffers passed in, the model."""
    model = _model()
    if policy is not None:
        remat.apply(model, policy=policy, where=lambda name, _: name == "0")
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    x = torch.randn(6, 8, dtype=F64, generator=torch.Generator().manual_seed(2))

    def loss(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, (p, b), (x,)).pow(2).sum()

    with RecomputeCounter() as counter:
        grads = grad(loss)(params, buffers)
    return grads, buffers, model, counter


@pytest.mark.parametrize("policy", POLICIES)
def test_batchnorm_buffers_passed_to_functional_call_update_once(policy: str) -> None:
    expected_grads, expected_buffers, _, _ = _run(None)
    grads, buffers, model, counter = _run(policy)
    torch.testing.assert_close(grads, expected_grads)
    # The running statistics moved once, as without remat (the recompute wrote a copy).
    torch.testing.assert_close(buffers, expected_buffers)
    assert int(buffers["0.1.num_batches_tracked"]) == 1
    # The module's own buffers were not passed in: nothing wrote them.
    assert int(model.get_buffer("0.1.num_batches_tracked")) == 0
    torch.testing.assert_close(model.get_buffer("0.1.running_mean"), torch.zeros(16, dtype=F64))
    assert_recomputed(policy, counter.counts, lambda: _run("nothing-saveable")[3].counts)
