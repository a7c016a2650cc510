"""Random ops in a region: the recompute draws the forward's numbers, or raises where it cannot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import F64, TORCH_FUNC_POLICIES, remat_offloading, seeded_f64, tree_close
from torch.func import grad, jacrev, vjp, vmap

import remat


def _drop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(x @ w, "h")
    return F.dropout(torch.tanh(h), 0.5, training=True) @ w


@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize("policy", TORCH_FUNC_POLICIES)
def test_dropout_under_vmap(policy: str, randomness: str) -> None:
    x, w = seeded_f64((4, 5), (5, 5))
    xs = torch.stack([x, -x, x])

    def vmap_of_grad(f: Callable[..., Any]) -> Any:
        torch.manual_seed(3)
        g = grad(lambda x, w: f(x, w).pow(2).sum(), argnums=(0, 1))
        return vmap(g, in_dims=(0, None), randomness=randomness)(xs, w)

    def grad_of_vmap(f: Callable[..., Any]) -> Any:
        torch.manual_seed(3)
        return grad(
            lambda x, w: vmap(f, in_dims=(0, None), randomness=randomness)(x, w).pow(2).sum(),
            argnums=(0, 1),
        )(xs, w)

    f = remat_offloading(_drop, policy)
    tree_close(vmap_of_grad(_drop), vmap_of_grad(f))
    tree_close(grad_of_vmap(_drop), grad_of_vmap(f))


def _dropout_region(policy: str) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    def f(h: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.sin(h), 0.5, training=True) * 2

    return f, remat.remat(f, policy=policy)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
@pytest.mark.parametrize("randomness", ["different", "error"])
def test_random_region_backward_under_a_new_vmap_raises(policy: str, randomness: str) -> None:
    _, g = _dropout_region(policy)
    x = torch.randn(6, dtype=F64)
    _, vjp_fn = vjp(g, x)
    with pytest.raises(remat.RematError, match="draws random numbers"):
        vmap(vjp_fn, randomness=randomness)(torch.eye(6, dtype=F64))
    with pytest.raises(remat.RematError, match="draws random numbers"):
        jacrev(g)(x)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_random_region_backward_under_vmap_same_randomness(policy: str) -> None:
    f, g = _dropout_region(policy)
    x = torch.randn(6, dtype=F64)
    torch.manual_seed(0)
    _, expected_fn = vjp(f, x)
    torch.manual_seed(0)
    _, vjp_fn = vjp(g, x)
    eye = torch.eye(6, dtype=F64)
    torch.testing.assert_close(
        vmap(vjp_fn, randomness="same")(eye), vmap(expected_fn, randomness="same")(eye)
    )


def test_random_eager_region_with_vmapped_autograd_grad_raises() -> None:
    _, g = _dropout_region("nothing-saveable")
    x = torch.randn(6, dtype=F64, requires_grad=True)
    out = g(x)

    def row(v: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(out, x, v, retain_graph=True)[0]

    with pytest.raises(remat.RematError, match="draws random numbers"):
        vmap(row, randomness="different")(torch.eye(6, dtype=F64))


def test_deterministic_region_backward_under_a_new_vmap_still_runs() -> None:
    g = remat.remat(lambda h: torch.sin(h) * h)
    x = torch.randn(6, dtype=F64)
    torch.testing.assert_close(jacrev(g)(x), jacrev(lambda h: torch.sin(h) * h)(x))
