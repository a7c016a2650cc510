"""Eager autograd and torch.func mixed around one region: each backward gets the same gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import TORCH_FUNC_POLICIES, named_block, remat_offloading, seeded_f64, tree_close
from torch.func import grad, vjp

import remat


def _blk_unnamed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) @ w


def _eager_through_vjp(f: Callable[..., torch.Tensor]) -> torch.Tensor:
    x, w = seeded_f64((4, 5), (5, 5))
    w = w.requires_grad_()
    out, fn = vjp(f, x, w)
    _, gw = fn(torch.ones_like(out))
    (gw.pow(2).sum() + out.sum()).backward()
    assert w.grad is not None
    return w.grad


def _eager_and_func(f: Callable[..., torch.Tensor]) -> Any:
    x, w = seeded_f64((4, 5), (5, 5))
    w = w.requires_grad_()
    y = f(x, w)  # an eager region
    g = grad(lambda x, w: f(x, w).sum(), argnums=1)(y.detach(), w)
    (y.pow(2).sum() + (g * w).sum()).backward()
    return w.grad, g


def _create_graph(f: Callable[..., torch.Tensor]) -> Any:
    x, w = seeded_f64((4, 5), (5, 5))
    w = w.requires_grad_()
    (g,) = torch.autograd.grad(f(x, w).pow(2).sum(), w, create_graph=True)
    g.sin().sum().backward()
    return w.grad


@pytest.mark.parametrize("policy", TORCH_FUNC_POLICIES)
def test_eager_and_torch_func_mixed_unnamed_region(policy: str) -> None:
    first, second = (remat_offloading(_blk_unnamed, policy) for _ in range(2))
    tree_close(_eager_through_vjp(_blk_unnamed), _eager_through_vjp(first))
    tree_close(_eager_and_func(_blk_unnamed), _eager_and_func(second))
    forced = remat.remat(_blk_unnamed, policy=policy, engine="functional")
    tree_close(_create_graph(_blk_unnamed), _create_graph(forced))


@pytest.mark.parametrize("policy", ["nothing-saveable", "offload-dots", "offload:h"])
def test_eager_and_torch_func_mixed_named_region_recompute_or_offload(policy: str) -> None:
    first, second = (remat_offloading(named_block, policy) for _ in range(2))
    tree_close(_eager_through_vjp(named_block), _eager_through_vjp(first))
    tree_close(_eager_and_func(named_block), _eager_and_func(second))


_NAMED_KEPT_BUG = (
    "bug: OpLog.name keeps a checkpoint_name'd value by detaching it from Python while the "
    "recorded forward's inner torch.func.vjp level is live, so the kept alias is a "
    "GradTrackingTensor of that level (dead after the forward); replay returns it and eager "
    "autograd above the torch.func engine loses the path through it: second-order eager "
    "gradients are silently wrong"
)


@pytest.mark.parametrize("policy", ["dots-saveable", "save:h", "offload-dots+save:h", "save-last"])
def test_eager_backward_of_vjp_fn_output_with_named_kept_value(policy: str) -> None:
    region = remat_offloading(named_block, policy)
    tree_close(_eager_through_vjp(named_block), _eager_through_vjp(region))


@pytest.mark.parametrize("policy", ["dots-saveable", "save:h", "save-last"])
def test_eager_backward_through_torch_func_grad_with_named_kept_value(policy: str) -> None:
    region = remat_offloading(named_block, policy)
    tree_close(_eager_and_func(named_block), _eager_and_func(region))


@pytest.mark.parametrize("policy", ["dots-saveable", "save:h"])
def test_create_graph_through_functional_engine_with_named_kept_value(policy: str) -> None:
    forced = remat.remat(named_block, policy=policy, engine="functional")
    tree_close(_create_graph(named_block), _create_graph(forced))


def test_named_kept_value_is_a_plain_tensor() -> None:
    """The root cause, directly: what a record keeps must carry no functorch level."""
    from remat._engines import functional as engine

    calls: list[Any] = []
    original = engine._Call.forward

    def spy(self: Any, tensors: Any) -> Any:
        calls.append(self)
        return original(self, tensors)

    x, w = seeded_f64((4, 5), (5, 5))
    engine._Call.forward = spy  # type: ignore[method-assign]
    try:
        vjp(remat.remat(named_block, policy="save:h"), x, w.requires_grad_())
    finally:
        engine._Call.forward = original  # type: ignore[method-assign]
    kept = calls[0].log.records[0].kept[0]
    assert not torch._C._functorch.is_functorch_wrapped_tensor(kept)
