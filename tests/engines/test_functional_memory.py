"""The torch.func engine at the eager engine's floor (NOTE [ The functional engine ] rule 13).

Peaks are exact (`MemoryMeter`): under ``torch.func.grad`` of a stack of regions
the torch.func engine holds what the eager engine holds under ``backward()``.
The recomputed output of the block whose backward runs, which ``torch.func.vjp``
held as its autograd root until its vjp ran (one block activation more than the
eager engine), is now an empty root (``_engines/functional/roots.py``).
What ``torch.func.grad`` itself keeps of the loss's own backward (it runs it
with ``create_graph=True``) is torch.func's, with remat as without.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import RecomputeCounter
from torch.func import functional_call, grad, vjp

import remat
from remat import _demo_model as demo
from remat._inspect.memory import MemoryMeter

DEPTH, WIDTH, BATCH, SEQ = 4, 32, 2, 16
#: One block's activation (float32), as a block's input or output.
ACTIVATION = BATCH * SEQ * WIDTH * 4


def _stack() -> tuple[demo.Stack, torch.Tensor]:
    stack = demo.Stack(depth=DEPTH, width=WIDTH, heads=2)
    return stack, demo.make_input(stack, batch=BATCH, seq=SEQ)


def _peak(step: Callable[[], Any]) -> tuple[int, Any]:
    with MemoryMeter() as meter:
        out = step()
    return meter.peak, out


def _eager(stack: demo.Stack, x: torch.Tensor, policy: str) -> tuple[int, dict[str, Any]]:
    for p in stack.parameters():
        p.grad = None

    def step() -> dict[str, Any]:
        stack.loss(x, policy).backward()
        return {k: p.grad for k, p in stack.named_parameters()}

    peak, grads = _peak(step)
    for p in stack.parameters():
        p.grad = None
    return peak, grads


def _under_grad(stack: demo.Stack, x: torch.Tensor, policy: str) -> tuple[int, dict[str, Any]]:
    # As torch.func's own examples pass parameters: detached (rule 13's last sentence).
    params = {k: v.detach() for k, v in stack.named_parameters()}

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = functional_call(stack, p, (x, policy)).pow(2).mean()
        return out

    return _peak(lambda: grad(loss)(params))


@pytest.mark.parametrize("policy", ["nothing-saveable", "save-last"])
def test_torch_func_grad_peaks_at_the_eager_engines_floor(policy: str) -> None:
    stack, x = _stack()
    eager_peak, eager_grads = _eager(stack, x, policy)
    with RecomputeCounter() as counter:
        func_peak, func_grads = _under_grad(stack, x, policy)
    _, expected = _under_grad(stack, x, demo.NO_REMAT)
    for k, g in expected.items():
        torch.testing.assert_close(func_grads[k], g)
        torch.testing.assert_close(eager_grads[k], g)
    # Every block but (under save-last) the last is recomputed: gelu once per block.
    assert counter.counts["gelu"] == (DEPTH - 1 if policy == "save-last" else DEPTH)
    # Before ``roots.py`` the recompute's output, its vjp's root: one activation more.
    assert func_peak == eager_peak == 251_656


def test_region_inputs_go_as_the_backward_passes() -> None:
    """Before rule 13 each region's input lived until ``grad`` returned: DEPTH - 1
    more activations at the peak (block 0's input is the caller's); before
    ``roots.py``, one more: the recomputed output its vjp held as root."""
    stack, x = _stack()
    nothing, _ = _under_grad(stack, x, "nothing-saveable")
    eager_peak, _ = _eager(stack, x, "nothing-saveable")
    assert nothing == eager_peak


def test_a_loss_that_saves_nothing_peaks_exactly_at_the_eager_engine() -> None:
    """With ``stack(x).sum()`` (whose backward keeps nothing under ``create_graph``)
    both policies peak at the eager engine's bytes; before ``roots.py`` one activation
    above (255,752 B against 251,656: the recomputed output the vjp held as root)."""
    stack, x = _stack()
    for policy in ("nothing-saveable", "save-last"):
        eager, func = _sum_loss_peaks(stack, x, policy)
        assert func == eager, (policy, eager, func)


def test_a_vjp_fn_called_twice_replays_twice() -> None:
    """A ``vjp_fn`` keeps its graph: the forward's records stay for its second call."""
    w = torch.randn(8, 8, dtype=torch.float64)

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).sin() @ w

    x = torch.randn(4, 8, dtype=torch.float64)
    for policy in ("dots-saveable", "save-last"):
        out, vjp_fn = vjp(remat.remat(block, policy=policy), x)
        expected_out, expected_fn = vjp(block, x)
        torch.testing.assert_close(out, expected_out)
        for seed in (1.0, -2.0):
            cotangent = torch.full_like(out, seed)
            with RecomputeCounter() as counter:
                (got,) = vjp_fn(cotangent)
            torch.testing.assert_close(got, expected_fn(cotangent)[0])
            assert counter.counts["mm"] == 0, (policy, counter.counts)  # replayed


def test_tuple_and_keyword_arguments_after_release() -> None:
    """Handed-over tensors in a tuple and in a keyword argument get their stand-ins
    substituted in every recompute, as the tensors were in the forward."""
    w = torch.randn(6, 6, dtype=torch.float64)

    def fn(pair: tuple[torch.Tensor, torch.Tensor], *, scale: tuple[torch.Tensor, float]) -> Any:
        a, b = pair
        return (torch.tanh(a @ w) * b).sin() * scale[0] * scale[1]

    a, b, s = (torch.randn(3, 6, dtype=torch.float64) for _ in range(3))
    wrapped = remat.remat(fn)
    got = grad(lambda a, b, s: wrapped((a, b), scale=(s, 2.0)).sum(), argnums=(0, 1, 2))(a, b, s)
    want = grad(lambda a, b, s: fn((a, b), scale=(s, 2.0)).sum(), argnums=(0, 1, 2))(a, b, s)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)
    out, vjp_fn = vjp(lambda a, b, s: wrapped((a, b), scale=(s, 2.0)), a, b, s)
    _, want_fn = vjp(lambda a, b, s: fn((a, b), scale=(s, 2.0)), a, b, s)
    for _ in range(2):
        for g, e in zip(vjp_fn(torch.ones_like(out)), want_fn(torch.ones_like(out)), strict=True):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("policy", ["nothing-saveable", "save-last", "dots-saveable"])
def test_higher_order_keeps_what_it_differentiates(policy: str) -> None:
    """grad(grad), hessian and jacfwd(jacrev) differentiate the backward: its graph stays."""
    w = torch.randn(5, 5, dtype=torch.float64)

    def block(x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ w).sin() @ w).pow(2).sum()

    x = torch.randn(5, dtype=torch.float64)
    wrapped = remat.remat(block, policy=policy)
    for transform in (
        lambda f: grad(lambda y: grad(f)(y).sin().sum()),
        torch.func.hessian,
        lambda f: torch.func.jacfwd(torch.func.jacrev(f)),
        lambda f: torch.func.jacrev(torch.func.jacrev(f)),
    ):
        torch.testing.assert_close(transform(wrapped)(x), transform(block)(x))


def _sum_loss_peaks(stack: demo.Stack, x: torch.Tensor, policy: str) -> tuple[int, int]:
    """Eager and torch.func peaks of ``stack(x).sum()``: a loss whose own backward
    saves nothing, so torch.func.grad's ``create_graph`` holds nothing extra."""
    for p in stack.parameters():
        p.grad = None
    eager, _ = _peak(lambda: stack(x, policy).sum().backward())
    for p in stack.parameters():
        p.grad = None
    params = {k: v.detach() for k, v in stack.named_parameters()}
    func, _ = _peak(lambda: grad(lambda q: functional_call(stack, q, (x, policy)).sum())(params))
    return eager, func


def _save_last_both_engines(
    depth: int,
) -> tuple[demo.Stack, torch.Tensor, int, int, RecomputeCounter]:
    """``save-last`` on a stack of ``depth`` blocks in both engines, gradients checked
    against no remat: the stack, its input, both peaks, what torch.func recomputed."""
    stack = demo.Stack(depth=depth, width=WIDTH, heads=2)
    x = demo.make_input(stack, batch=BATCH, seq=SEQ)
    eager_peak, eager_grads = _eager(stack, x, "save-last")
    with RecomputeCounter() as counter:
        func_peak, func_grads = _under_grad(stack, x, "save-last")
    _, expected = _under_grad(stack, x, demo.NO_REMAT)
    for k, g in expected.items():
        torch.testing.assert_close(func_grads[k], g)
        torch.testing.assert_close(eager_grads[k], g)
    return stack, x, eager_peak, func_peak, counter


def test_the_latest_save_last_region_holds_what_autograd_saves() -> None:
    """Under torch.func the latest ``save-last`` region holds its forward's graph
    (``_engines/functional/held.py``), not every op's output: one block peaks where the
    eager engine does. Before, it recorded every output: 149,640 B against 99,208."""
    stack, x, eager_peak, func_peak, counter = _save_last_both_engines(depth=1)
    assert counter.counts.get("gelu", 0) == 0  # the held graph, nothing recomputed
    # ``pow(2).mean()``'s backward under torch.func.grad (create_graph=True) keeps the
    # stack's output and the mean's cotangent: two activations of torch.func's own.
    assert func_peak == eager_peak + 2 * ACTIVATION == 107_400
    eager_sum, func_sum = _sum_loss_peaks(stack, x, "save-last")
    assert func_sum == eager_sum


def test_a_demoted_save_last_region_recomputes_from_its_inputs() -> None:
    """Two blocks: the first is demoted by the second and recomputed; the second's
    backward differentiates its held graph. Before: 157,832 B, now the eager engine's
    peak plus one activation (the recomputed block's output, the root of its vjp);
    now the eager engine's peak (``roots.py``)."""
    _, _, eager_peak, func_peak, counter = _save_last_both_engines(depth=2)
    assert counter.counts["gelu"] == 1
    assert func_peak == eager_peak == 154_120 - ACTIVATION
