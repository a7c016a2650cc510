"""Regions under ``vmap`` whose outputs do (or do not) depend on the batched inputs.

With torch's generated vmap rule an output that does not depend on the batch had
its gradient multiplied by the batch size; the region's own vmap rule runs
``vmap(fn)`` as one call, so every composition gives the no-remat gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import CORE_POLICIES, OpCounter
from torch.func import grad, hessian, jacfwd, jacrev, vmap

import remat

Outputs = tuple[torch.Tensor, torch.Tensor]


def mixed(x: torch.Tensor, w: torch.Tensor) -> Outputs:
    """One output depends on ``x`` (batched), one only on ``w`` (unbatched)."""
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    return h @ w, (w**2).sum()


def batched_only(x: torch.Tensor, w: torch.Tensor) -> Outputs:
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    return h @ w, (h * x).sum()


def unbatched_only(x: torch.Tensor, w: torch.Tensor) -> Outputs:
    # Neither output depends on the batched ``x`` (it is only read for its shape).
    h = remat.checkpoint_name(torch.tanh(w @ w), "hidden")
    return h.sum() * x.shape[-1], (h @ w).sin()


FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], Outputs]] = {
    "mixed": mixed,
    "batched_only": batched_only,
    "unbatched_only": unbatched_only,
}

# in_dims of (x, w): x batched at 0 or 1, w unbatched or batched too.
IN_DIMS: dict[str, tuple[int | None, int | None]] = {
    "x0": (0, None),
    "x1": (1, None),
    "x0_w0": (0, 0),
    "w0": (None, 0),
}


def _inputs(in_dims: tuple[int | None, int | None]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(5, 2, 3, dtype=torch.float64)  # batch 5 of (2, 3)
    if in_dims[0] is None:
        x = x[0]
    if in_dims[0] == 1:
        x = x.transpose(0, 1).contiguous()
    w = torch.randn(3, 3, dtype=torch.float64)
    if in_dims[1] == 0:
        w = torch.randn(5, 3, 3, dtype=torch.float64)
    return x, w


def _loss(fn: Callable[..., Outputs], in_dims: tuple[int | None, int | None]) -> Callable[..., Any]:
    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a, b = vmap(fn, in_dims=in_dims)(x, w)
        return a.pow(2).sum() + 3 * b.sum()

    return loss


@pytest.mark.parametrize("policy", CORE_POLICIES)
@pytest.mark.parametrize("dims", list(IN_DIMS))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_grad_of_vmap(name: str, dims: str, policy: str) -> None:
    fn, in_dims = FUNCTIONS[name], IN_DIMS[dims]
    region = remat.remat(fn, policy=policy)
    x, w = _inputs(in_dims)
    expected = grad(_loss(fn, in_dims), argnums=(0, 1))(x, w)
    actual = grad(_loss(region, in_dims), argnums=(0, 1))(x, w)
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("policy", CORE_POLICIES)
@pytest.mark.parametrize("dims", list(IN_DIMS))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_eager_backward_through_vmap(name: str, dims: str, policy: str) -> None:
    fn, in_dims = FUNCTIONS[name], IN_DIMS[dims]
    region = remat.remat(fn, policy=policy)
    x, w = _inputs(in_dims)

    def grads(f: Callable[..., Outputs]) -> tuple[torch.Tensor, ...]:
        xs = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        _loss(f, in_dims)(*xs).backward()
        # An input no output depends on: None without remat, zeros through the
        # region's Function (an input of it either way). Same values.
        return tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in xs)

    torch.testing.assert_close(grads(region), grads(fn))


@pytest.mark.parametrize("policy", ("nothing-saveable", "dots-saveable"))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_jacrev_of_vmap(name: str, policy: str) -> None:
    fn = FUNCTIONS[name]
    region = remat.remat(fn, policy=policy)
    x, w = _inputs((0, None))

    def outputs(f: Callable[..., Outputs]) -> Callable[..., torch.Tensor]:
        def flat(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            a, b = vmap(f, in_dims=(0, None))(x, w)
            return torch.cat([a.reshape(-1), b.reshape(-1)])

        return flat

    expected = jacrev(outputs(fn), argnums=(0, 1))(x, w)
    torch.testing.assert_close(jacrev(outputs(region), argnums=(0, 1))(x, w), expected)


@pytest.mark.parametrize("policy", CORE_POLICIES)
@pytest.mark.parametrize("dims", list(IN_DIMS))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_vmap_of_grad(name: str, dims: str, policy: str) -> None:
    fn, in_dims = FUNCTIONS[name], IN_DIMS[dims]
    region = remat.remat(fn, policy=policy)
    x, w = _inputs(in_dims)

    def per_example(f: Callable[..., Outputs]) -> Callable[..., torch.Tensor]:
        def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            a, b = f(x, w)
            return a.pow(2).sum() + 3 * b.sum()

        return loss

    expected = vmap(grad(per_example(fn), argnums=(0, 1)), in_dims=in_dims)(x, w)
    actual = vmap(grad(per_example(region), argnums=(0, 1)), in_dims=in_dims)(x, w)
    torch.testing.assert_close(actual, expected)


def test_unbatched_output_keeps_out_dims_none() -> None:
    # vmap(..., out_dims=None) accepts an output that does not depend on the batch.
    region = remat.remat(mixed)
    x, w = _inputs((0, None))
    out_dims = (0, None)

    def loss(f: Callable[..., Outputs]) -> Callable[..., torch.Tensor]:
        def inner(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            a, b = vmap(f, in_dims=(0, None), out_dims=out_dims)(x, w)
            assert b.shape == ()
            return a.pow(2).sum() + 3 * b

        return inner

    expected = grad(loss(mixed), argnums=(0, 1))(x, w)
    torch.testing.assert_close(grad(loss(region), argnums=(0, 1))(x, w), expected)


def _matmuls(counter: OpCounter) -> int:
    return sum(counter.counts[name] for name in ("mm", "bmm", "addmm", "baddbmm"))


@pytest.mark.parametrize("transform", ["grad_of_vmap", "vmap_of_grad"])
def test_dots_saveable_replays_matmuls_under_vmap(transform: str) -> None:
    x, w = _inputs((0, None))

    def run(f: Callable[..., Outputs]) -> int:
        if transform == "grad_of_vmap":
            call = lambda: grad(_loss(f, (0, None)), argnums=(0, 1))(x, w)  # noqa: E731
        else:
            def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                a, b = f(x, w)
                return a.pow(2).sum() + 3 * b.sum()

            call = lambda: vmap(grad(loss, argnums=(0, 1)), in_dims=(0, None))(x, w)  # noqa: E731
        with OpCounter() as counter:
            call()
        return _matmuls(counter)

    reference = run(mixed)
    forward_only = 2  # x @ w and h @ w
    assert run(remat.remat(mixed, policy="dots-saveable")) == reference
    assert run(remat.remat(mixed, policy="nothing-saveable")) == reference + forward_only


@pytest.mark.parametrize("policy", ("nothing-saveable", "dots-saveable"))
@pytest.mark.parametrize(
    "transform", ["jacfwd_of_vmap", "hessian_of_vmap", "grad_of_vmap_of_vmap", "vmap_grad_vmap"]
)
def test_other_compositions(transform: str, policy: str) -> None:
    region = remat.remat(mixed, policy=policy)
    x, w = _inputs((0, None))
    xx = torch.randn(4, 5, 2, 3, dtype=torch.float64)

    def run(f: Callable[..., Outputs]) -> Any:
        inner = vmap(f, in_dims=(0, None))
        if transform == "jacfwd_of_vmap":
            flat = lambda x, w: torch.cat([o.reshape(-1) for o in inner(x, w)])  # noqa: E731
            return jacfwd(flat, argnums=1)(x, w)
        if transform == "hessian_of_vmap":
            return hessian(_loss(f, (0, None)), argnums=1)(x, w)
        twice = vmap(inner, in_dims=(0, None))
        if transform == "grad_of_vmap_of_vmap":
            loss = lambda x, w: sum(o.pow(2).sum() for o in twice(x, w))  # noqa: E731
            return grad(loss, argnums=(0, 1))(xx, w)
        loss = lambda x, w: sum(o.pow(2).sum() for o in inner(x, w))  # noqa: E731
        return vmap(grad(loss, argnums=(0, 1)), in_dims=(0, None))(xx, w)

    torch.testing.assert_close(run(region), run(mixed))


def _dropout(x: torch.Tensor, w: torch.Tensor) -> Outputs:
    return torch.nn.functional.dropout(torch.tanh(x @ w), 0.5), (w**2).sum()


@pytest.mark.parametrize("policy", ("nothing-saveable", "dots-saveable"))
def test_dropout_under_grad_of_vmap_replays_masks(policy: str) -> None:
    x, w = _inputs((0, None))

    def run(f: Callable[..., Outputs]) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(1)
        batched = vmap(f, in_dims=(0, None), randomness="different")
        loss = lambda x, w: sum(o.pow(2).sum() for o in batched(x, w))  # noqa: E731
        return grad(loss, argnums=(0, 1))(x, w)  # type: ignore[no-any-return]

    torch.testing.assert_close(run(remat.remat(_dropout, policy=policy)), run(_dropout))
