"""A view backward saves of a value the policy recomputes is recomputed too.

A view shares its base's storage, so keeping it keeps every byte of the value
the policy frees: a ``Linear`` on a 3-D input saves such a view for its ``mm``
(NOTE [ Record and replay ] rule 8 in ``remat/_replay/records.py``). Memory is
exact on CPU, so the bytes are asserted to the byte; the recompute runs the
named op only (the attention before it gets the tensors backward holds, rule 5).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import Engine
from helpers import RecomputeCounter, assert_close_all

import remat
from remat import _demo_model as demo
from remat._inspect.memory import MemoryMeter


def viewed(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(F.gelu(x @ w1), "h")
    return h.view(2, 8, 64).view(-1, 64) @ w2  # mm saves a view of h


def direct(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(F.gelu(x @ w1), "h")
    return h @ w2  # mm saves h itself


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    return x, torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)


def held(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The bytes kept for backward after the forward (the output excluded), and the output."""
    with MemoryMeter() as meter:
        for t in xs:
            meter.add_baseline(t)
        out = fn(*xs)
        return meter.current - out.untyped_storage().nbytes(), out


@pytest.mark.parametrize("fn", [viewed, direct])
def test_a_saved_view_of_a_dropped_name_is_freed(fn: Callable[..., torch.Tensor]) -> None:
    x, w1, w2 = inputs()
    h_bytes = 16 * 64 * 4
    plain, out = held(fn, x, w1, w2)
    expected = torch.autograd.grad(out.sum(), [w1, w2])
    region = remat.remat(fn, policy="everything-except:h", engine="eager")
    kept, out = held(region, x, w1, w2)
    assert plain - kept == h_bytes, (plain, kept)  # exactly h: x @ w1 stays (gelu's input)
    with RecomputeCounter() as counter:
        actual = torch.autograd.grad(out.sum(), [w1, w2])
    assert_close_all(actual, expected)
    assert dict(counter.counts) == {"gelu": 1}  # h again, from the kept x @ w1


@pytest.mark.parametrize("policy", ["everything-except:h", "save-except:h", "dots-saveable"])
def test_views_of_dropped_values_keep_gradients(engine: Engine, policy: str) -> None:
    x, w1, w2 = inputs()
    expected = engine.grads(lambda *a: viewed(*a).sin().sum(), x, w1, w2)
    region: Any = engine.remat(viewed, policy=policy)
    assert_close_all(engine.grads(lambda *a: region(*a).sin().sum(), x, w1, w2), expected)


def test_the_demo_block_frees_mlp_hidden_and_recomputes_only_it() -> None:
    # fc2 is a Linear on a 3-D input: it saves a view of mlp_hidden.
    torch.manual_seed(0)
    block = demo.Block(16, 2)
    x = torch.randn(2, 4, 16)
    plain, out = held(block, x)
    expected = torch.autograd.grad(out.sum(), list(block.parameters()))
    region = remat.remat(block, policy="everything-except:mlp_hidden", engine="eager")
    kept, out = held(region, x)
    assert plain - kept == 2 * 4 * 64 * 4, (plain, kept)  # mlp_hidden: (2, 4, 4 * 16) float32
    with RecomputeCounter() as counter:
        actual = torch.autograd.grad(out.sum(), list(block.parameters()))
    assert_close_all(actual, expected)
    # Only gelu runs again: attention, before it, is not rerun on meta stand-ins
    # (which would pick its math kernel, and make the engine recompute everything).
    assert dict(counter.counts) == {"gelu": 1}
