"""Regions under torch.func transforms: ``remat(fn)`` differentiates exactly like ``fn``.

Every test compares a rematerialized program with the same program without
remat, in float64, under torch.func transforms (and eager autograd mixed in).
Offload policies run with a `FakeHostStore(min_bytes=0)`, so every offloaded
value really goes through the store on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import TORCH_FUNC_POLICIES, named_block, remat_offloading, seeded_f64, tree_close
from torch.func import grad, hessian, jacfwd, jacrev, vjp, vmap

import remat
from remat._offload.fake import FakeHostStore

TRANSFORMS = ("grad", "vjp2", "jacrev", "jacfwd", "vmap_grad", "grad_grad", "hessian", "eager")


# -- regions: 2-D/3-D linear, einsum, conv, sdpa ----------------------------------------


def _lin2(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(x @ w + b, "h")
    return (torch.tanh(h) @ w.T).sin()


def _lin3(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(F.linear(x, w, b), "h")
    return F.gelu(torch.einsum("bij,jk->bik", torch.tanh(h), w))


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(F.conv2d(x, w, b, padding=1), "h")
    return torch.tanh(h).square()


def _sdpa(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    q = remat.checkpoint_name(x @ w, "h")
    return (F.scaled_dot_product_attention(q, x, x) * b).tanh()


REGIONS: dict[str, tuple[Callable[..., torch.Tensor], tuple[tuple[int, ...], ...]]] = {
    "lin2": (_lin2, ((4, 5), (5, 5), (5,))),
    "lin3": (_lin3, ((2, 3, 5), (5, 5), (5,))),
    "conv": (_conv, ((1, 2, 4, 4), (2, 2, 3, 3), (2,))),
    "sdpa": (_sdpa, ((2, 3, 5), (5, 5), (5,))),
}


def _apply(transform: str, f: Callable[..., torch.Tensor], x: Any, w: Any, b: Any) -> Any:
    def loss(x: Any, w: Any, b: Any) -> torch.Tensor:
        return f(x, w, b).pow(2).sum()

    if transform == "grad":
        return grad(loss, argnums=(0, 1, 2))(x, w, b)
    if transform == "vjp2":  # the same vjp_fn twice, different cotangents
        out, fn = vjp(f, x, w, b)
        return out, fn(torch.ones_like(out)), fn(out.detach().cos())
    if transform == "jacrev":
        return jacrev(f, argnums=(1, 2))(x, w, b)
    if transform == "jacfwd":
        return jacfwd(f, argnums=2)(x, w, b)
    if transform == "vmap_grad":
        return vmap(grad(loss, argnums=(1, 2)), in_dims=(0, None, None))(
            torch.stack([x, 2 * x]), w, b
        )
    if transform == "grad_grad":
        return grad(lambda x, w, b: grad(loss, argnums=1)(x, w, b).sin().sum(), argnums=(0, 1, 2))(
            x, w, b
        )
    if transform == "hessian":
        return hessian(loss, argnums=2)(x, w, b)
    assert transform == "eager"
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss(*leaves).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("region", sorted(REGIONS))
def test_regions_under_transforms_all_policies(region: str, transform: str) -> None:
    fn, shapes = REGIONS[region]
    x, w, b = seeded_f64(*shapes)
    expected = _apply(transform, fn, x, w, b)
    for policy in TORCH_FUNC_POLICIES:
        store = FakeHostStore(min_bytes=0)
        tree_close(expected, _apply(transform, remat_offloading(fn, policy, store), x, w, b))


# -- outputs: partially unused, views of inputs, the inputs, ints, non-tensors ------


def _multi(x: torch.Tensor, w: torch.Tensor) -> dict[str, Any]:
    h = remat.checkpoint_name(x @ w, "h")
    a = torch.tanh(h)
    return {
        "a": a,
        "view": x[1:],
        "t": x.t(),
        "count": (h > 0).long().sum(),
        "argmax": h.argmax(-1),
        "same": x,
        "n": 3,
        "b": (a @ w).sin(),
    }


def _multi_loss(f: Callable[..., dict[str, Any]]) -> Callable[..., torch.Tensor]:
    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        o = f(x, w)
        assert o["n"] == 3 and o["count"].dtype == torch.long
        return 2 * o["view"].sum() + o["t"].pow(2).sum() + o["same"].sum() + o["a"].sum()

    return loss


@pytest.mark.parametrize("policy", TORCH_FUNC_POLICIES)
def test_views_ints_and_unused_outputs(policy: str) -> None:
    x, w = seeded_f64((4, 5), (5, 5))
    for t in (
        lambda f: grad(_multi_loss(f), argnums=(0, 1))(x, w),
        lambda f: jacfwd(_multi_loss(f), argnums=(0, 1))(x, w),
        lambda f: hessian(_multi_loss(f), argnums=1)(x, w),
        lambda f: vmap(grad(_multi_loss(f), argnums=1), in_dims=(0, None))(torch.stack([x, -x]), w),
    ):
        tree_close(t(_multi), t(remat_offloading(_multi, policy)))


# -- nesting ------------------------------------------------------------------------


@pytest.mark.parametrize("outer", TORCH_FUNC_POLICIES)
@pytest.mark.parametrize("inner", ["nothing-saveable", "offload-dots", "save-last"])
def test_functional_inside_functional(outer: str, inner: str) -> None:
    x, w = seeded_f64((4, 5), (5, 5))
    inner_fn = remat_offloading(named_block, inner)

    def ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (named_block(x, w).cos() * named_block(x, w)).pow(2).sum()

    got_region = remat.remat(
        lambda x, w: inner_fn(x, w).cos() * named_block(x, w),
        policy=outer,
        offload_store=FakeHostStore(min_bytes=0),
        engine="functional",
    )

    def got(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return got_region(x, w).pow(2).sum()

    tree_close(grad(ref, argnums=(0, 1))(x, w), grad(got, argnums=(0, 1))(x, w))
    tree_close(
        grad(lambda x, w: grad(ref, argnums=1)(x, w).sum())(x, w),
        grad(lambda x, w: grad(got, argnums=1)(x, w).sum())(x, w),
    )
    tree_close(jacfwd(ref, argnums=1)(x, w), jacfwd(got, argnums=1)(x, w))


def test_eager_engine_forced_inside_grad_raises_not_zero() -> None:
    x, w = seeded_f64((4, 5), (5, 5))
    f = remat.remat(named_block, engine="eager")
    with pytest.raises(remat.RematError, match=r"engine='eager' inside a torch\.func transform"):
        grad(lambda x, w: f(x, w).sum(), argnums=1)(x, w)


# -- the same region twice, save_last stacks of mixed policies ----------------------


@pytest.mark.parametrize("first", TORCH_FUNC_POLICIES)
def test_same_region_twice_and_mixed_stacks(first: str) -> None:
    x, w = seeded_f64((4, 5), (5, 5))

    def program(f1: Callable[..., Any], f2: Callable[..., Any]) -> Callable[..., torch.Tensor]:
        return lambda x, w: f2(f1(f1(x, w).sin(), w), w).pow(2).sum() + f1(x, 2 * w).sum()

    for second in ("save-last", "offload-dots", "save-last+offload-dots"):
        f1, f2 = remat_offloading(named_block, first), remat_offloading(named_block, second)
        tree_close(
            grad(program(named_block, named_block), argnums=(0, 1))(x, w),
            grad(program(f1, f2), argnums=(0, 1))(x, w),
        )
        tree_close(
            vmap(grad(program(named_block, named_block), argnums=1), in_dims=(0, None))(
                torch.stack([x, -x]), w
            ),
            vmap(grad(program(f1, f2), argnums=1), in_dims=(0, None))(torch.stack([x, -x]), w),
        )
        tree_close(
            hessian(program(named_block, named_block), argnums=0)(x[:2], w),
            hessian(program(f1, f2), argnums=0)(x[:2], w),
        )


# -- checkpoint_name on inputs and views, under vmap --------------------------------


def _named_inputs(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xi = remat.checkpoint_name(x, "h")
    v = remat.checkpoint_name(xi[..., 1:], "h")
    wt = remat.checkpoint_name(w.T, "h")
    return torch.tanh(x @ wt).sum() + v.sin().sum()


@pytest.mark.parametrize("policy", TORCH_FUNC_POLICIES)
def test_checkpoint_name_on_inputs_and_views_under_vmap(policy: str) -> None:
    x, w = seeded_f64((4, 5), (5, 5))
    xs = torch.stack([x, -x])
    f = remat_offloading(_named_inputs, policy)
    tree_close(
        vmap(grad(_named_inputs, argnums=(0, 1)), in_dims=(0, None))(xs, w),
        vmap(grad(f, argnums=(0, 1)), in_dims=(0, None))(xs, w),
    )
    tree_close(
        jacrev(vmap(_named_inputs, in_dims=(0, None)), argnums=1)(xs, w),
        jacrev(vmap(f, in_dims=(0, None)), argnums=1)(xs, w),
    )
