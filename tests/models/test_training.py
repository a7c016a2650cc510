"""A user's training loop: several optimizer steps, remat against no remat, step by step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat._demo_model import Block


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        Block(16, 2), nn.Dropout(0.1), Block(16, 2), nn.BatchNorm1d(6), Block(16, 2)
    )


def _train(model: nn.Module, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)  # same data and dropout masks for both models
        x = torch.randn(4, 6, 16)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "policy", ["nothing-saveable", "dots-saveable", "save-last+dots-saveable", "save:attn_out"]
)
def test_training_steps_match_no_remat(policy: str) -> None:
    plain = _model()
    rematerialized = remat.apply(copy.deepcopy(plain), policy=policy, where=Block)
    assert _train(rematerialized) == pytest.approx(_train(plain), rel=1e-5)
    for (name, p), q in zip(plain.named_parameters(), rematerialized.parameters(), strict=True):
        torch.testing.assert_close(q, p, msg=name)
    for (name, b), c in zip(plain.named_buffers(), rematerialized.buffers(), strict=True):
        torch.testing.assert_close(c, b, msg=name)  # BatchNorm statistics updated once per step


def test_sequential_training_matches_no_remat() -> None:
    plain = _model()
    copied = copy.deepcopy(plain)

    class Segmented(nn.Module):
        def __init__(self, layers: nn.Sequential) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return remat.sequential(self.layers, x, segments=3, policy="save-last")

    assert _train(Segmented(copied)) == pytest.approx(_train(plain), rel=1e-5)
    for p, q in zip(plain.parameters(), copied.parameters(), strict=True):
        torch.testing.assert_close(q, p)
