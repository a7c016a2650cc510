"""``torch.inference_mode()`` blocks inside a region.

A constant made under ``inference_mode`` inside a region is an inference tensor: it
has no version counter and autograd never saves it. remat does not keep it either
(reading its version raised "Inference tensors do not track version counter"); the
recompute makes it again. Where torch itself refuses (a ``torch.func``-transformed
tensor read under ``inference_mode``, which the torch.func engine's backward always
has), remat raises `RematError` saying to use ``torch.no_grad()``, which works.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import WIDE_POLICIES, OpCounter

import remat
from tests.conftest import Engine

#: The wide set and save_last over a recomputed name (the constant is recomputed).
INFERENCE_POLICIES = (*WIDE_POLICIES, "save-last+everything-except:hidden")


def island(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        scale = torch.exp(-torch.arange(3.0)) + 1.0  # a constant: an inference tensor
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    return ((h + scale) @ w * scale.clone()).sum()


@pytest.mark.parametrize("policy", INFERENCE_POLICIES)
def test_inference_constant_inside_region(engine: Engine, policy: str) -> None:
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    expected = engine.grads(island, x, w)
    found = engine.grads(engine.remat(island, policy=policy), x, w)
    for a, b in zip(found, expected, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("policy", ["everything-except:hidden", "dots-saveable"])
def test_inference_constant_is_made_again_not_kept(policy: str) -> None:
    """What the eager recompute runs: the island again (never kept), and tanh (dropped)."""
    xs = torch.randn(4, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    out = remat.remat(island, policy=policy, engine="eager")(*xs)
    with OpCounter() as counter:
        torch.autograd.grad(out, xs)
    assert counter.counts["tanh"] == 1  # hidden is recomputed under both policies
    assert counter.counts["arange"] == 1 and counter.counts["exp"] == 1
    # Of the (3,)-shaped values only the clone (a normal tensor) may be kept.
    kept = remat.saved_residuals(island, *xs, policy=policy)
    ops = {r.op for r in kept if r.shape == (3,)}
    assert ops <= {torch.ops.aten.clone.default}, kept


def test_inference_tensor_input() -> None:
    """An inference tensor passed in (as an argument), used where autograd saves nothing.

    Eager engine only: the torch.func engine's ``autograd.Function`` saves its
    inputs, which torch refuses for an inference tensor (torch's own clear error).
    """
    engine = Engine("eager")
    with torch.inference_mode():
        bias = torch.randn(3, 3)

    def f(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(w + b), "hidden")
        return (h @ w).sum()

    w = torch.randn(3, 3)
    expected = engine.grads(lambda w: f(w, bias), w)
    for policy in ("nothing-saveable", "dots-saveable", "save:hidden", "save-last"):
        region = engine.remat(f, policy=policy)
        found = engine.grads(functools.partial(_call, region, b=bias), w)
        torch.testing.assert_close(found, expected)


def _call(region: Any, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = region(w, b)
    return out


def _reads_input_in_inference_mode(block: Callable[..., Any]) -> Callable[..., Any]:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with block():
            stats = (x.detach() ** 2).mean(0)
        h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
        return ((h + stats) @ w).sum()

    return f


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save:hidden",
                                    "save-last"])
@pytest.mark.parametrize("how", ["torch.func.grad", "backward"])
def test_functional_engine_says_to_use_no_grad(policy: str, how: str) -> None:
    """The torch.func engine runs fn on transformed tensors: torch refuses them under
    inference_mode. The message names the region and the fix, and the fix works."""
    bad = _reads_input_in_inference_mode(torch.inference_mode)
    good = _reads_input_in_inference_mode(torch.no_grad)
    x, w = torch.randn(4, 3), torch.randn(3, 3)

    def run(fn: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
        if how == "torch.func.grad":
            return torch.func.grad(remat.remat(fn, policy=policy), argnums=(0, 1))(x, w)
        xs = x.clone().requires_grad_(), w.clone().requires_grad_()
        return torch.autograd.grad(remat.remat(fn, policy=policy, engine="functional")(*xs), xs)

    with pytest.raises(remat.RematError) as info:
        run(bad)
    message = str(info.value)
    assert "_reads_input_in_inference_mode.<locals>.f (" in message  # the region, with its line
    assert "torch.inference_mode()" in message and "Use torch.no_grad() instead" in message
    if how == "backward":
        assert "engine='eager'" in message
        xs = x.clone().requires_grad_(), w.clone().requires_grad_()
        eager = torch.autograd.grad(remat.remat(bad, policy=policy, engine="eager")(*xs), xs)
        expected = torch.autograd.grad(bad(*xs), xs)
        for a, b in zip(eager, expected, strict=True):
            torch.testing.assert_close(a, b)
    xs = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = torch.autograd.grad(good(*xs), xs)
    for a, b in zip(run(good), expected, strict=True):  # the fix the message gives
        torch.testing.assert_close(a, b)
