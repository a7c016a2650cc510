"""A backward's vjp starts from empty roots (``_engines/functional/roots.py``).

The recomputed outputs are not held as the vjp's roots: what each output's own
graph saved of it stays (``exp`` saves its result), the rest goes. Gradients
must not change for any kind of output: one its node saves, a view, an output
another output is computed from, an input returned as is, an output written in
place, an integer output, an output the loss does not read. And where the
backward is differentiated or batched the outputs stay roots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import Engine
from helpers import OpCounter, RecomputeCounter
from torch.func import grad, jacrev, jvp, vmap

import remat

POLICIES = ("nothing-saveable", "dots-saveable", "save-last")

torch.manual_seed(0)
W = torch.randn(6, 6, dtype=torch.float64)


def saved_by_its_node(x: torch.Tensor) -> Any:
    return torch.exp(torch.tanh(x @ W) @ W * 0.1)


def a_view(x: torch.Tensor) -> Any:
    return torch.tanh(x @ W).t()


def one_from_another(x: torch.Tensor) -> Any:
    h = torch.sin(x @ W)
    return h @ W, h, x


def written_in_place(x: torch.Tensor) -> Any:
    y = torch.tanh(x @ W) @ W
    y.mul_(2.0)
    return y


def with_an_integer(x: torch.Tensor) -> Any:
    y = torch.sin(x @ W) @ W
    return y, y.argmax(-1)


CASES: dict[str, Callable[[torch.Tensor], Any]] = {
    f.__name__: f
    for f in (saved_by_its_node, a_view, one_from_another, written_in_place, with_an_integer)
}


def _loss(fn: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor) -> torch.Tensor:
        out = fn(x)
        outs = out if isinstance(out, tuple) else (out,)
        return sum(((o.sin() * o).sum() for o in outs if o.is_floating_point()), x.new_zeros(()))

    return loss


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_gradients_of_every_kind_of_output(engine: Engine, case: str, policy: str) -> None:
    fn = CASES[case]
    x = torch.randn(4, 6, dtype=torch.float64)
    (want,) = torch.autograd.grad(_loss(fn)(x.requires_grad_()), x)
    with OpCounter() as forward:
        fn(x.detach())
    wrapped = engine.remat(fn, policy=policy)
    with RecomputeCounter() as counter:
        (got,) = engine.grads(_loss(wrapped), x.detach())
    torch.testing.assert_close(got, want)
    assert counter.counts["mm"] == _mms_recomputed(engine, case, policy, forward.counts["mm"])


def _mms_recomputed(engine: Engine, case: str, policy: str, in_forward: int) -> int:
    """One region, so ``save-last`` holds it. ``dots-saveable`` replays every mm but one
    written in place after it was kept (the torch.func engine runs that one again).
    ``nothing-saveable``: the torch.func engine recomputes ``fn`` whole; the eager engine
    stops at the last tensor its backward unpacks (the last mm only where a node after
    it saves a value made from it: ``exp``, ``tanh``)."""
    if policy == "save-last":
        return 0
    if policy == "dots-saveable":
        return int(engine.name == "functional" and case == "written_in_place")
    if engine.name == "functional" or case in ("saved_by_its_node", "a_view"):
        return in_forward
    return in_forward - 1


@pytest.mark.parametrize("policy", POLICIES)
def test_an_output_the_loss_does_not_read(policy: str) -> None:
    x = torch.randn(4, 6, dtype=torch.float64)
    wrapped = remat.remat(one_from_another, policy=policy)
    got = grad(lambda x: wrapped(x)[1].pow(2).sum())(x)
    want = grad(lambda x: one_from_another(x)[1].pow(2).sum())(x)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("policy", POLICIES)
def test_batched_and_differentiated_backwards_keep_their_roots(policy: str) -> None:
    """vmap(grad), grad(grad) and jacrev(jacrev) of a region with every kind of output."""
    xs = torch.randn(3, 2, 6, dtype=torch.float64)
    for fn in CASES.values():
        wrapped = remat.remat(fn, policy=policy)
        for transform in (
            lambda f: vmap(grad(_loss(f))),
            lambda f: vmap(grad(lambda y: grad(_loss(f))(y).sin().sum())),
            lambda f: vmap(jacrev(jacrev(_loss(f)))),
        ):
            torch.testing.assert_close(transform(wrapped)(xs), transform(fn)(xs))


@pytest.mark.parametrize("policy", POLICIES)
def test_forward_mode_around_the_backward_keeps_its_roots(policy: str) -> None:
    """``jvp(grad)``: the backward runs under a forward-mode level, where an empty root
    would need a ``jvp`` rule of its own (torch raises without ``may_root``'s check)."""
    x, t = (torch.randn(4, 6, dtype=torch.float64) for _ in range(2))
    for fn in CASES.values():
        wrapped = remat.remat(fn, policy=policy)
        got = jvp(grad(_loss(wrapped)), (x,), (t,))
        torch.testing.assert_close(got, jvp(grad(_loss(fn)), (x,), (t,)))
