"""CPU autocast (bfloat16): gradients equal no remat's bit for bit, in both engines.

Autograd casts a parameter once per autocast block (the cast cache) and runs
attention's inner ops outside autocast; torch.func's levels cast each use and
every inner op again. So ``loss.backward()`` gets autograd's program (the
torch.func engine hands such calls to the eager engine: NOTE [ Engine
selection ] rule 4), ``torch.func.grad`` gets torch.func's (both engines'
forwards run as the backward's ``vjp``), and the eager engine's recompute may
find the forward's casts cached, or not (NOTE [ Autocast's cast cache ]).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from tests.helpers import DOTS, RecomputeCounter

POLICIES = ("nothing-saveable", "dots-saveable", "save-last", "budget:0.5")


def _autocast() -> contextlib.AbstractContextManager[None]:
    return torch.autocast("cpu", dtype=torch.bfloat16)


class _Block(nn.Module):
    """Attention (a composite op) and a parameter used twice (cast once, cached)."""

    def __init__(self, inside: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 8)
        self.inside = inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _autocast() if self.inside else contextlib.nullcontext():
            h = F.gelu(self.l1(x))
            a = F.scaled_dot_product_attention(h[None], h[None], h[None])[0]
            return self.l2(h + a) + 0.5 * self.l2(h)


def _model(inside: bool = False) -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(_Block(inside), _Block(inside))


X = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))


def _backward(model: nn.Module, where: str) -> dict[str, torch.Tensor]:
    """Gradients by ``loss.backward()``: inside the autocast block, after it, or with
    the region entering autocast itself (``inside``)."""
    block = _autocast() if where != "inside" else contextlib.nullcontext()
    with block:
        y = model(X)
        if where == "in":
            y.float().pow(2).sum().backward()
    if where != "in":
        y.float().pow(2).sum().backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), (k, (got[k] - expected[k]).abs().max())


@contextlib.contextmanager
def _recomputes(policy: str) -> Iterator[collections.Counter[str]]:
    """Count the recomputed ops; assert what ``policy`` recomputes of the first block
    (the last one keeps everything under ``save-last``)."""
    with RecomputeCounter() as counter:
        yield counter.counts
    total = sum(counter.counts.values())
    dots = sum(n for op, n in counter.counts.items() if op in DOTS)
    assert total > 0, f"{policy} recomputed nothing"
    if policy == "dots-saveable":
        assert dots == 0, counter.counts
    if policy == "nothing-saveable":
        assert dots > 0, counter.counts


@pytest.mark.parametrize("where", ["in", "after"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("engine", ["eager", "functional"])
def test_loss_backward_under_autocast_is_autograds(engine: str, policy: str, where: str) -> None:
    expected = _backward(_model(), where)
    model = _model()
    remat.apply(model, where=_Block, policy=policy, engine=engine)
    with _recomputes(policy):
        got = _backward(model, where)
    _equal(got, expected)


def _func_grad(model: nn.Module, around: Callable[[], contextlib.AbstractContextManager[None]]
               ) -> dict[str, torch.Tensor]:
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = torch.func.functional_call(model, p, (X,))
        return out.float().pow(2).sum()

    with around():
        grads: dict[str, torch.Tensor] = torch.func.grad(loss)(params)
    return grads


@pytest.mark.parametrize("policy", POLICIES)
def test_torch_func_grad_under_autocast_is_torch_funcs(policy: str) -> None:
    # No remat here is torch.func's program: its casts differ from autograd's.
    expected = _func_grad(_model(), _autocast)
    assert any(not torch.equal(expected[k], v) for k, v in _backward(_model(), "in").items())
    model = _model()
    remat.apply(model, where=_Block, policy=policy)
    with _recomputes(policy):
        got = _func_grad(model, _autocast)
    _equal(got, expected)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_autocast_entered_inside_the_region_names_the_engine_that_works(policy: str) -> None:
    expected = _backward(_model(inside=True), "inside")
    model = _model(inside=True)
    remat.apply(model, where=_Block, policy=policy, engine="functional")
    with pytest.raises(remat.RematError) as info:
        _backward(model, "inside")
    message = str(info.value)
    assert "_Block.forward" in message and __file__ in message, message
    assert "torch.autocast entered inside the region" in message and "engine='eager'" in message
    for fix in ("eager", "auto"):  # the fix the message names, and the default
        model = _model(inside=True)
        remat.apply(model, where=_Block, policy=policy, engine=fix)
        with _recomputes(policy):
            got = _backward(model, "inside")
        _equal(got, expected)


@pytest.mark.parametrize("where", ["in", "after"])
@pytest.mark.parametrize("policy", ["dots-saveable", "budget:0.5"])
def test_casts_the_forward_found_cached_are_run_again_in_the_recompute(
    policy: str, where: str
) -> None:
    # One block called before the region and in it: the region's forward finds its
    # casts cached. After the autocast block the recompute casts them; inside it, the
    # recompute takes them from the cache too.
    torch.manual_seed(1)
    block = _Block()
    expected = _backward(_Twice(block, lambda x: block(block(x))), where)
    torch.manual_seed(1)
    block = _Block()
    region = remat.remat(block, policy=policy, engine="eager")

    def twice(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = region(block(x))
        return out

    with _recomputes(policy):
        got = _backward(_Twice(block, twice), where)
    _equal(got, expected)


class _Twice(nn.Module):
    def __init__(self, block: nn.Module, run: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.block = block
        self.run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)
