"""save_last: the most recent region keeps everything it saved.

When the next region starts, the one before is demoted to its base policy. Stacks
interleaved with gradient accumulation, retained graphs, ``no_grad`` forwards and a
new step in between must still give the plain gradients.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from helpers import Fn, same_grads, same_state, train_both, w44, x3
from torch import nn

import remat
from remat._offload.fake import FakeHostStore


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ((x @ w).tanh() @ w).sin()


@pytest.mark.parametrize(
    "policy", ["save-last", "save-last+dots-saveable", "save-last+offload-dots"]
)
def test_interleaved_save_last_stacks_with_accumulation(policy: str) -> None:
    def model(f: Fn, g: Fn, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h1, k1 = f(x, w), g(x, w)
        h2 = f(h1, w)
        return g(k1 + h2, w).sum() + h2.sum()

    def run(f: Fn, g: Fn) -> torch.Tensor:
        torch.manual_seed(3)
        x, w = x3(), w44()
        (model(f, g, x, w) + model(f, g, 2 * x, w)).backward()  # two forwards, one backward
        assert w.grad is not None
        return w.grad

    def other(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _block(x, w).cos()

    store = FakeHostStore(min_bytes=0)
    actual = run(
        remat.remat(_block, policy=policy, offload_store=store),
        remat.remat(other, policy=policy, offload_store=store),
    )
    torch.testing.assert_close(actual, run(_block, other))


def test_retain_graph_then_demotion_then_second_backward() -> None:
    f = remat.remat(
        _block, policy="save-last+offload-dots", offload_store=FakeHostStore(min_bytes=0)
    )
    x, w = x3(), w44()
    loss = f(x, w).sum()
    (first,) = torch.autograd.grad(loss, w, retain_graph=True)
    f(x, w)  # a new save_last region: demotes the first one
    (second,) = torch.autograd.grad(loss, w)
    torch.testing.assert_close(first, second)
    (reference,) = torch.autograd.grad(_block(x, w).sum(), w)
    torch.testing.assert_close(second, reference)


def _net() -> nn.Module:
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.GELU()) for _ in range(4)]
    )


@pytest.mark.parametrize("policy", ["save-last", "save-last+dots-saveable"])
def test_gradient_accumulation_two_forwards_one_backward(policy: str) -> None:
    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        a = remat.sequential(m, x[:3], segments=4, policy=policy) if m.remat else m(x[:3])
        b = remat.sequential(m, x[3:], segments=4, policy=policy) if m.remat else m(x[3:])
        return torch.cat([a, b])

    def build() -> nn.Module:
        m = _net()
        m.remat = False
        return m

    def prepare(m: nn.Module) -> nn.Module:
        m.remat = True
        return m

    train_both(build, prepare)


@pytest.mark.parametrize("order", ["first-first", "second-first"])
def test_gradient_accumulation_two_backwards(order: str) -> None:
    torch.manual_seed(0)
    ref = _net()
    got = copy.deepcopy(ref)
    remat.apply(got, where=lambda n, m: n.count(".") == 0 and n != "", policy="save-last")
    x1, x2 = torch.randn(3, 4), torch.randn(3, 4)
    for m in (ref, got):
        l1, l2 = m(x1).pow(2).sum(), m(x2).pow(2).sum()
        for loss in (l1, l2) if order == "first-first" else (l2, l1):
            loss.backward()
    same_grads(ref, got, 0)
    same_state(ref, got, 0)


def test_save_last_graph_dropped_then_new_step() -> None:
    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if m.remat:
            # A forward whose graph is dropped without backward (a skipped batch).
            remat.sequential(m, x * 3, segments=4, policy="save-last")
            gc.collect()
            return remat.sequential(m, x, segments=4, policy="save-last")
        m(x * 3)
        return m(x)

    def build() -> nn.Module:
        m = _net()
        m.remat = False
        return m

    def prepare(m: nn.Module) -> nn.Module:
        m.remat = True
        return m

    train_both(build, prepare)


def test_save_last_wrapped_blocks_with_no_grad_eval_between() -> None:
    train_both(
        _net,
        lambda m: remat.apply(m, where=lambda n, s: n in {"0", "1", "2", "3"}, policy="save-last"),
        eval_between=True,
        steps=4,
    )


def test_save_last_stack_interleaved_with_no_grad_forward() -> None:
    torch.manual_seed(0)
    ref = _net()
    got = remat.apply(copy.deepcopy(ref), where=lambda n, s: n.isdigit(), policy="save-last")
    x = torch.randn(5, 4)
    for m in (ref, got):
        y = m(x)
        with torch.no_grad():
            m(x + 1)  # a no-grad forward (monitoring) before backward
        y.pow(2).sum().backward()
    same_grads(ref, got, 0)
    same_state(ref, got, 0)
