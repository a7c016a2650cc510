"""remat.sequential: segments of a layer stack, pytree activations between them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import train_both
from torch import nn

import remat


class DictLayer(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.i = i

    def forward(self, state: dict[str, Any]) -> dict[str, Any]:
        h, (a, b) = state["h"], state["pair"]
        h = torch.tanh(self.norm(self.lin(h))) + a * b
        return {"h": h, "pair": (b, h.sum(0)), "depth": state["depth"] + 1}


class Tuple2Dict(nn.Module):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
        return {"h": x[0], "pair": (x[1], x[1] * 2), "depth": 0}


def _pytree_layers() -> nn.Module:
    return nn.Sequential(Tuple2Dict(), *[DictLayer(i) for i in range(5)])


@pytest.mark.parametrize("segments", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("policy", ["save-last", "nothing-saveable", "save-last+dots-saveable"])
def test_sequential_pytree_activations(segments: int, policy: str) -> None:
    def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        inp = (x, x[0] * 0.5)
        out = remat.sequential(m, inp, segments=segments, policy=policy)
        assert out["depth"] == 5
        return out["h"] + out["pair"][1]

    train_both(_pytree_layers, lambda m: m, call=lambda m, x: call(m, x), steps=2)


def test_sequential_pytree_plain_reference_matches() -> None:
    torch.manual_seed(0)
    m = _pytree_layers()
    x = torch.randn(6, 4)
    a = remat.sequential(m, (x, x[0]), segments=3)
    m.eval()
    with torch.no_grad():
        b = remat.sequential(m, (x, x[0]), segments=3)
    assert a["depth"] == b["depth"] == 5


def _layer_counts(policy: str, segments: int, n: int = 6) -> list[int]:
    counts = [0] * n
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *a, i=i: counts.__setitem__(i, counts[i] + 1))
    remat.sequential(
        layers, torch.randn(2, 4, requires_grad=True), segments=segments, policy=policy
    ).sum().backward()
    return counts


@pytest.mark.parametrize("segments", [1, 2, 3, 6])
def test_sequential_save_last_vs_nothing_saveable_counts(segments: int) -> None:
    size = 6 // segments
    last = 6 - (segments - 1) * size
    assert _layer_counts("save-last", segments) == [2] * (6 - last) + [1] * last
    assert _layer_counts("nothing-saveable", segments) == [2] * 6
