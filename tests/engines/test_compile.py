"""Regions under ``torch.compile`` that do not lower: they run eagerly (a graph break).

The code around them compiles. Regions that lower into the compiled graph are
tested in ``test_lowering.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import (
    assert_close_all,
    batch84,
    compile_inputs,
    grads,
    two_blocks,
)
from torch import nn

import remat

pytestmark = [
    # Dynamo reads ``.grad`` of the tensors it wraps and hides the warning that
    # raises with its own display filter, which pytest's "error" filter overrides.
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
]


def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
    return torch.sin(h @ w2) + x


@pytest.mark.parametrize("policy", ["offload:hidden", "save-last", "offload-dots"])
def test_compiled_gradients_match_eager(policy: str) -> None:
    torch._dynamo.reset()
    inputs = compile_inputs()
    expected = grads(two_blocks(block), inputs)
    runs: list[bool] = []

    def counted(*args: torch.Tensor) -> torch.Tensor:
        runs.append(remat.is_recomputing())
        return block(*args)

    rematerialized = two_blocks(remat.remat(counted, policy=policy))
    torch.autograd.grad(rematerialized(*inputs), inputs)
    eager_runs = list(runs)
    assert eager_runs.count(False) == 2
    compiled = torch.compile(rematerialized, backend="aot_eager")
    for _ in range(2):  # the second call reuses the compiled graphs
        runs.clear()
        actual = torch.autograd.grad(compiled(*inputs), inputs)
        assert_close_all(actual, expected)
        # The regions ran in remat's engine, not traced away: the same forwards
        # and recomputes as without torch.compile.
        assert runs == eager_runs


def test_compiled_module_with_wrapped_blocks() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8), torch.nn.Tanh()
    )
    x = torch.randn(4, 8)
    expected = torch.autograd.grad(net(x).square().sum(), list(net.parameters()))
    remat.apply(net, where=torch.nn.Linear, policy="save-last")  # not lowered
    compiled = torch.compile(net, backend="aot_eager")
    actual = torch.autograd.grad(compiled(x).square().sum(), list(net.parameters()))
    assert_close_all(actual, expected)


@pytest.mark.parametrize("policy", ["nothing-saveable", "save-last", "dots-saveable"])
@pytest.mark.parametrize(
    "fn",
    [lambda x: x.exp().exp().tanh(), lambda x: x.exp() + x.tanh() + x.sigmoid()],
    ids=["chain", "sum"],
)
def test_backward_inside_compiled_code(policy: str, fn: Callable[..., torch.Tensor]) -> None:
    # Found by review: Dynamo compiled the recompute that ``backward()`` runs,
    # which then saved other tensors than the forward (wrong gradients).
    torch._dynamo.reset()

    def step(x: torch.Tensor, f: Callable[..., torch.Tensor]) -> torch.Tensor:
        loss = f(x).square().sum()
        loss.backward()
        return loss.detach()

    x = torch.linspace(-1, 1, 8, dtype=torch.double).reshape(2, 4).requires_grad_()
    step(x, fn)
    expected, x.grad = x.grad, None
    torch.compile(step, backend="aot_eager")(x, remat.remat(fn, policy=policy))
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_torch_func_grad_compiled_with_a_region(backend: str) -> None:
    # A region under torch.func is a graph break (the torch.func engine runs
    # eagerly). Under backend="eager", torch 2.13 cannot resume tracing after any
    # graph break inside torch.func.grad: converting the grad-tracking tensor to a
    # fake one fails ("False != True", its is_leaf). The same program without
    # remat, with torch._dynamo.graph_break() where the region was, fails alike;
    # remat cannot avoid the break. Other backends run, right.
    torch._dynamo.reset()
    x, w1, w2 = (t.detach() for t in compile_inputs()[:3])
    region = remat.remat(lambda x, w: torch.tanh(x @ w) @ w2, policy="dots-saveable")

    def with_region(w: torch.Tensor) -> torch.Tensor:
        return region(x, w).sum()

    def with_break(w: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x @ w) @ w2
        torch._dynamo.graph_break()
        return y.sum()

    expected = torch.func.grad(lambda w: (torch.tanh(x @ w) @ w2).sum())(w1)
    for fn in (with_region, with_break):
        torch._dynamo.reset()
        compiled = torch.compile(torch.func.grad(fn), backend=backend)
        if backend == "eager":
            with pytest.raises(AssertionError, match="False != True"):
                compiled(w1)
        else:
            torch.testing.assert_close(compiled(w1), expected)


# torch warns that global hooks fire for the compiled wrapper too (harmless here).
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
# Dynamo reads ``.grad`` of the tensors it wraps and hides that warning itself.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_compiled_module_inside_a_region_compiles_once() -> None:
    torch._dynamo.reset()
    compiles = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        compiles.append(gm)
        return gm.forward

    plain = nn.Sequential(nn.Linear(4, 4).double(), nn.Tanh())
    inner = torch.compile(copy.deepcopy(plain), backend=backend)
    region = remat.remat(lambda h: inner(h).sin())
    h = batch84().requires_grad_()
    (expected,) = torch.autograd.grad(plain(h).sin().sum(), h)
    for _ in range(5):
        (actual,) = torch.autograd.grad(region(h).sum(), h)
        torch.testing.assert_close(actual, expected)
    # The watching hook stays registered: a handle per call would change the
    # global hook table torch.compile guards on, and recompile every call.
    assert len(compiles) <= 2
    # Under the region's saved-tensor hooks (never traced) it runs eagerly (docs/modules.md).
    assert not compiles
