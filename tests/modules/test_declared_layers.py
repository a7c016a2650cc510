"""`remat.apply` without ``where`` finds declared layers without importing transformers."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import remat


def test_apply_without_where_needs_no_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with pytest.raises(ValueError, match="Sequential declares no checkpointable layers"):
        remat.apply(model, policy="dots-saveable")
    assert not any(remat.is_wrapped(m) for m in model.modules())


def test_a_layer_declared_by_class_identity_is_found() -> None:
    # A class named and placed as Hugging Face's is what is looked for (by MRO, not import).
    declared = type("GradientCheckpointingLayer", (nn.Module,), {
        "__module__": "transformers.modeling_layers",
        "forward": lambda self, x: torch.tanh(self.lin(x)),
    })
    lookalike = type("GradientCheckpointingLayer", (nn.Module,), {
        "forward": lambda self, x: torch.tanh(self.lin(x)),
    })
    model = nn.Sequential(declared(), lookalike())
    for layer in model:
        layer.lin = nn.Linear(3, 3)
    remat.apply(model)
    assert [remat.is_wrapped(m) for m in model] == [True, False]
    x = torch.randn(2, 3, requires_grad=True)
    (g,) = torch.autograd.grad(model(x).sum(), x)
    remat.unwrap(model)
    (expected,) = torch.autograd.grad(model(x).sum(), x)
    torch.testing.assert_close(g, expected)
