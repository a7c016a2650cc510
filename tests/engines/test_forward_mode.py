"""Forward mode (jvp, jacfwd, linearize) and nested forward mode around a region."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from helpers import CORE_POLICIES, F64
from torch.func import grad, hessian, jacfwd, jvp

import remat
from remat._inspect.memory import MemoryMeter
from remat._offload.fake import FakeHostStore


def _second_order_forward(kind: str, f: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    ones = torch.ones(4, dtype=F64)
    if kind == "jvp_jvp":
        return lambda w: torch.func.jvp(
            lambda v: torch.func.jvp(f, (v,), (ones,))[1], (w,), (ones,)
        )
    if kind == "jacfwd_jacfwd":
        return jacfwd(jacfwd(f))
    if kind == "jacfwd_jvp":
        return jacfwd(lambda w: torch.func.jvp(f, (w,), (ones,))[1])
    assert kind == "grad_jvp_jvp"  # a reverse level around them: still exact
    second = _second_order_forward("jvp_jvp", f)
    return grad(lambda w: second(w)[1])


@pytest.mark.parametrize("kind", ["jvp_jvp", "jacfwd_jacfwd", "jacfwd_jvp", "grad_jvp_jvp"])
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_nested_forward_mode(kind: str, policy: str) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(4, dtype=F64), torch.randn(4, dtype=F64)

    def f(h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.sin(h * v).sum() * torch.cos(h @ v)

    region = remat.remat(f, policy=policy)
    expected = _second_order_forward(kind, lambda v: f(x, v))(w)
    actual = _second_order_forward(kind, lambda v: region(x, v))(w)
    optree.tree_map(torch.testing.assert_close, actual, expected)
    assert all(bool(t.abs().sum() > 0) for t in optree.tree_leaves(expected))  # not zero anyway


# linearize traces its jvp with zero tensors, which have no storage (found by review).
@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node")  # torch's const folding
@pytest.mark.parametrize(
    "policy", ["everything-except:a", "save-last", "dots-saveable", "offload-dots", "save:a"]
)
def test_linearize(policy: str) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(3, 4, dtype=F64), torch.randn(4, 4, dtype=F64)

    def f(h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.sin(remat.checkpoint_name(h @ v, "a")).sum(-1)

    region = remat.remat(f, policy=policy)
    with remat.use_host_store(FakeHostStore(min_bytes=0)):
        out, jvp_fn = torch.func.linearize(lambda v: region(x, v), w)
    expected_out, expected_fn = torch.func.linearize(lambda v: f(x, v), w)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(jvp_fn(w.cos()), expected_fn(w.cos()))


# One functorch jvp is one forward-mode level (it enters the eager dual level too):
# the Function runs, and its jvp rule (and hessian's backward) recompute ``fn``.
@pytest.mark.parametrize("policy", CORE_POLICIES)
@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian", "vmap(jacfwd)"])
def test_one_forward_mode_level_recomputes_the_region(transform: str, policy: str) -> None:
    recomputes: list[bool] = []

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        recomputes.append(remat.is_recomputing())
        return (torch.tanh(remat.checkpoint_name(x @ w, "hidden")) ** 2).sum()

    def run(g: Callable[..., torch.Tensor]) -> Any:
        if transform == "jvp":
            return jvp(g, (x, w), (x.cos(), w.sin()))
        if transform == "vmap(jacfwd)":
            return torch.func.vmap(jacfwd(g, argnums=1), in_dims=(0, None))(xs, w)
        return (jacfwd if transform == "jacfwd" else hessian)(g, argnums=(0, 1))(x, w)

    torch.manual_seed(0)
    x, w = torch.randn(3, 4, dtype=F64), torch.randn(4, 4, dtype=F64)
    xs = torch.randn(2, 3, 4, dtype=F64)
    want = run(f)
    recomputes.clear()
    got = run(remat.remat(f, policy=policy))
    optree.tree_map(torch.testing.assert_close, got, want)
    # The forward ran fn once, plainly; every other run was a recompute.
    assert recomputes[0] is False and len(recomputes) > 1, (transform, recomputes)
    assert all(recomputes[1:]), (transform, recomputes)


def test_hessian_of_a_rematerialized_stack_peaks_lower() -> None:
    # hessian's inner jacrev differentiates the regions: remat keeps their inputs only
    # (exact bytes on CPU; with fn run plainly the peaks were equal).
    torch.manual_seed(0)
    x = torch.randn(64, 16, dtype=F64)
    ws = [torch.randn(16, 16, dtype=F64) * 0.3 for _ in range(6)]
    v = torch.randn(16, dtype=F64)

    def block(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(h @ w) @ w.T)

    def peak(blk: Callable[..., torch.Tensor]) -> tuple[int, torch.Tensor]:
        def f(u: torch.Tensor) -> torch.Tensor:
            h = x * u
            for w in ws:
                h = blk(h, w)
            return (h**2).sum()

        with MemoryMeter() as meter:
            for t in (x, v, *ws):
                meter.add_baseline(t)
            result = hessian(f)(v)
        return meter.peak, result

    plain, expected = peak(block)
    rematted, actual = peak(remat.remat(block, policy="nothing-saveable"))
    torch.testing.assert_close(actual, expected)
    assert rematted < plain, (rematted, plain)
