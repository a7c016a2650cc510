"""A tensor the region reads without receiving it, modified in place before backward.

Plain autograd raises (the saved tensor's version changed). Under remat the
recompute would silently use the new values; both engines must raise
`SavedInputMutatedError` naming the region and the tensor, and modifying it
after the backward (the fix the message gives) must give the plain gradients.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import CORE_POLICIES
from torch import nn

import remat
from remat import SavedInputMutatedError

D = torch.float64
SCALE = torch.linspace(0.5, 1.5, 4, dtype=D)


def _math(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    return (h * scale).sin().sum()


def _uses_global(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _math(x, w, SCALE)


class _Holder:
    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale


class Scaled(nn.Module):
    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _math(x, w, self.scale)


def _place(kind: str, scale: torch.Tensor) -> tuple[Callable[..., torch.Tensor], str]:
    """A function reading ``scale`` from ``kind`` of place, and the name it has there."""
    if kind == "global":
        SCALE.copy_(scale)
        return _uses_global, "SCALE"
    if kind == "closure":
        return (lambda x, w: _math(x, w, scale)), "scale"
    if kind == "list":
        # The other entry changes freely: no op reads it (as in plain autograd).
        consts = {"scales": [scale, torch.ones(4, dtype=D)]}
        CONSTS[:] = [consts]
        return (lambda x, w: _math(x, w, consts["scales"][0])), "consts"
    if kind == "attribute":
        holder = _Holder(scale)
        return (lambda x, w: _math(x, w, holder.scale)), "scale"
    assert kind == "buffer"
    return Scaled(scale), "scale"


CONSTS: list[dict[str, list[torch.Tensor]]] = []


def _forward_then_backward(
    engine: Any, fn: Callable[..., torch.Tensor], between: Callable[[], None]
) -> tuple[torch.Tensor, ...]:
    """Gradients w.r.t. (x, w) of ``fn``, with ``between()`` run after the forward."""
    torch.manual_seed(1)
    x, w = torch.randn(3, 4, dtype=D), torch.randn(4, 4, dtype=D)
    if engine.name == "eager":
        leaves = [x.requires_grad_(), w.requires_grad_()]
        out = fn(*leaves)
        between()
        return torch.autograd.grad(out, leaves)
    out, vjp_fn = torch.func.vjp(fn, x, w)
    between()
    return tuple(vjp_fn(torch.ones_like(out)))


@pytest.mark.parametrize("kind", ["global", "closure", "list", "attribute", "buffer"])
@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_modified_before_backward_raises(engine: Any, policy: str, kind: str) -> None:
    scale = torch.linspace(0.5, 1.5, 4, dtype=D)
    plain, name = _place(kind, scale)
    region = engine.remat(plain, policy=policy)
    target = SCALE if kind == "global" else scale

    def modify() -> None:
        with torch.no_grad():
            target.mul_(10)
            if kind == "list":
                CONSTS[0]["scales"][1].add_(1)  # unread: alone it would raise nothing

    with pytest.raises(SavedInputMutatedError) as caught:
        _forward_then_backward(engine, region, modify)
    message = str(caught.value)
    label = region.__remat_region__.label  # type: ignore[attr-defined]
    assert label in message  # the region: its function and source line
    assert re.search(rf"\b{name}\b", message), message  # the tensor
    assert "after the backward" in message or "after backward" in message

    # The fix the message gives: modify it after the backward.
    with torch.no_grad():
        target.div_(10)
    expected = _forward_then_backward(engine, plain, lambda: None)
    got = _forward_then_backward(engine, region, lambda: None)
    modify()
    torch.testing.assert_close(got, expected)
    assert torch.equal(target, torch.linspace(0.5, 1.5, 4, dtype=D) * 10)


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_plain_autograd_raises_too(policy: str) -> None:
    # The behaviour remat matches: autograd's own check on what it saved.
    scale = torch.linspace(0.5, 1.5, 4, dtype=D)
    fn, _ = _place("closure", scale)
    x, w = torch.randn(3, 4, dtype=D), torch.randn(4, 4, dtype=D, requires_grad=True)
    out = fn(x, w)
    with torch.no_grad():
        scale.mul_(10)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_an_entry_no_op_reads_changes_freely(engine: Any, policy: str) -> None:
    # Plain autograd checks only what it saved: another entry of a closed-over dict
    # (optimizer state, a cache) may change between forward and backward.
    scale = torch.linspace(0.5, 1.5, 4, dtype=D)
    plain, _ = _place("list", scale)
    unread = CONSTS[0]["scales"][1]

    def modify() -> None:
        with torch.no_grad():
            unread.add_(1)

    expected = _forward_then_backward(engine, plain, lambda: None)
    got = _forward_then_backward(engine, engine.remat(plain, policy=policy), modify)
    torch.testing.assert_close(got, expected)
    assert torch.equal(unread, torch.full((4,), 2.0, dtype=D))
