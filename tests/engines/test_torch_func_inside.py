"""A region whose function runs a torch.func transform itself, under ``loss.backward()``.

Force fields and physics losses: ``forces = -torch.func.grad(energy)(pos)`` inside
the region, the loss on the forces. torch refuses to start ``grad``/``vjp``/
``jacrev``/``hessian`` under saved-tensor hooks (the eager engine). With the default
``engine="auto"`` remat notices it when the transform starts (before the transform
ran anything), runs the call under the torch.func engine instead, and goes there
directly on later calls. ``engine="eager"``, or a first attempt that already changed
state remat cannot put back, raises `RematError` with a fix that works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import (
    CORE_POLICIES,
    OpCounter,
    assert_close_each,
    tree_close,
)
from torch import nn
from torch.func import grad

import remat

#: A torch.func transform inside the region: the core policies and a name recomputed.
INSIDE_POLICIES = (*CORE_POLICIES, "everything-except:hidden")


def energy(pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(pos @ w), "hidden")
    return (h**2).sum()


def forces_loss(pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    scaled = pos * 1.5  # an op before the transform
    forces = -torch.func.grad(energy)(scaled, w)
    return (forces**2).sum()


def jacobian_loss(pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    jac = torch.func.jacrev(lambda p: torch.sin(p @ w))(pos[0])
    return (jac**2).sum() + torch.cos(pos @ w).sum()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(5, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)


def _grads(fn: Callable[..., torch.Tensor], xs: tuple[torch.Tensor, ...]) -> Any:
    return torch.autograd.grad(fn(*xs), xs)


@pytest.mark.parametrize("policy", INSIDE_POLICIES)
@pytest.mark.parametrize("fn", [forces_loss, jacobian_loss], ids=["grad", "jacrev"])
def test_auto_engine_runs_torch_func_inside(policy: str, fn: Callable[..., torch.Tensor]) -> None:
    xs = _inputs()
    expected = _grads(fn, xs)
    region = remat.remat(fn, policy=policy)
    assert_close_each(_grads(region, xs), expected)
    assert_close_each(_grads(region, xs), expected)  # later calls: the torch.func engine at once


def test_first_call_detects_later_calls_go_straight() -> None:
    """What runs: the first call runs the op before the transform twice (the refused
    attempt, then the torch.func engine); later calls once, as without remat."""

    def counted(fn: Callable[..., torch.Tensor], xs: tuple[torch.Tensor, ...]) -> int:
        with OpCounter() as counter:
            fn(*xs)
        return counter.counts["mul"]

    xs = _inputs()

    def loss(pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # a fresh label
        return forces_loss(pos, w)

    plain = counted(forces_loss, xs)
    region = remat.remat(loss, policy="nothing-saveable")
    assert counted(region, xs) > plain
    assert counted(region, xs) == plain


def test_backward_recomputes_the_region() -> None:
    """Under nothing-saveable the backward recomputes the region (more ops than plain)."""
    xs = _inputs()

    def backward_ops(fn: Callable[..., torch.Tensor]) -> int:
        out = fn(*xs)
        with OpCounter() as counter:
            torch.autograd.grad(out, xs)
        return counter.counts["tanh"]

    assert backward_ops(forces_loss) == 0
    assert backward_ops(remat.remat(forces_loss, policy="nothing-saveable")) > 0


def test_random_ops_before_the_transform_are_rewound() -> None:
    def loss(pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        noisy = torch.nn.functional.dropout(pos, 0.5, training=True)
        return forces_loss(noisy, w)

    xs = _inputs()
    torch.manual_seed(3)
    expected = _grads(loss, xs)
    after_plain = torch.rand(1)
    torch.manual_seed(3)
    assert_close_each(_grads(remat.remat(loss, policy="dots-saveable"), xs), expected)
    torch.testing.assert_close(torch.rand(1), after_plain)  # the stream moved as without remat


def test_engine_eager_says_to_use_functional() -> None:
    xs = _inputs()
    with pytest.raises(remat.RematError) as info:
        _grads(remat.remat(forces_loss, engine="eager"), xs)
    message = str(info.value)
    assert "forces_loss (" in message and "test_torch_func_inside.py" in message
    assert "calls a torch.func transform" in message and "Use engine='functional'" in message
    assert_close_each(_grads(remat.remat(forces_loss, engine="functional"), xs),
                  _grads(forces_loss, xs))


def test_state_changed_before_the_transform_raises() -> None:
    """An input written in place before the transform: running fn again would write it
    twice, so remat raises instead, and the fix it gives writes it once."""

    def loss(pos: torch.Tensor, w: torch.Tensor, calls: torch.Tensor) -> torch.Tensor:
        calls.add_(1)
        return forces_loss(pos, w)

    xs = _inputs()
    calls = torch.zeros(())
    with pytest.raises(remat.RematError) as info:
        remat.remat(loss)(*xs, calls)
    message = str(info.value)
    assert "test_state_changed_before_the_transform_raises.<locals>.loss (" in message
    assert "modified an input in place" in message
    assert "Make the part that calls the transform a region of its own" in message
    # The fix: the write outside, the transform in a region of its own.
    calls.zero_()
    region = remat.remat(forces_loss)
    calls.add_(1)
    found = torch.autograd.grad(region(*xs), xs)
    assert calls.item() == 1
    assert_close_each(found, _grads(forces_loss, xs))


def test_batchnorm_before_the_transform_raises() -> None:
    norm = nn.BatchNorm1d(3)

    def loss(pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return forces_loss(norm(pos), w)

    xs = _inputs()
    with pytest.raises(remat.RematError, match=r"a module's buffers \(BatchNorm statistics\)"):
        remat.remat(loss)(*xs)
    reference = nn.BatchNorm1d(3)
    norm.reset_running_stats()
    region = remat.remat(forces_loss)  # the fix: BatchNorm outside the region
    found = torch.autograd.grad(region(norm(xs[0]), xs[1]), xs)
    expected = torch.autograd.grad(forces_loss(reference(xs[0]), xs[1]), xs)
    assert_close_each(found, expected)
    torch.testing.assert_close(norm.running_mean, reference.running_mean)  # updated once
    assert int(norm.num_batches_tracked) == 1


def test_under_torch_func_grad_too() -> None:
    """The same region under torch.func.grad outside (the torch.func engine already)."""
    pos, w = torch.randn(5, 3), torch.randn(3, 3)
    expected = torch.func.grad(forces_loss, argnums=(0, 1))(pos, w)
    found = torch.func.grad(remat.remat(forces_loss, policy="dots-saveable"), argnums=(0, 1))(
        pos, w
    )
    assert_close_each(found, expected)


def test_wrapped_module_switches_once_and_a_parameter_into_the_transform_is_loud() -> None:
    """A module's own parameter handed to the inner transform cannot be substituted.

    ``torch.func.grad(energy)(scaled, self.w)`` wraps ``self.w`` itself, so the
    torch.func engine cannot give that transform its view of the parameter:
    remat raises, and the fix it names (pass the tensor as an argument) works.
    """

    class Field(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 3))

        def forward(self, pos: torch.Tensor) -> torch.Tensor:
            return forces_loss(pos, self.w)

    model = Field()
    pos = torch.randn(5, 3, requires_grad=True)
    expected = torch.autograd.grad(model(pos), (pos, model.w))
    remat.wrap(model, policy="dots-saveable")
    with pytest.raises(remat.RematError, match="as an argument"):
        model(pos)
    region = remat.remat(forces_loss, policy="dots-saveable")  # the fix: w is an argument
    for _ in range(2):  # the second call goes to the torch.func engine directly
        assert_close_each(torch.autograd.grad(region(pos, model.w), (pos, model.w)), expected)


def test_sequential_segments_with_a_closed_over_weight_into_the_transform_are_loud() -> None:
    """remat.sequential segments (one label for all) running torch.func inside.

    The layers close over ``w`` and hand it to ``torch.func.grad``: refused (as for
    a module's parameter above); the fix, ``w`` as an argument of each region, works.
    """
    w = torch.randn(3, 3, requires_grad=True)

    def step(pos: torch.Tensor) -> torch.Tensor:
        return pos - 0.1 * torch.func.grad(energy)(pos, w)

    def step_of(pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return pos - 0.1 * torch.func.grad(energy)(pos, w)

    pos = torch.randn(5, 3, requires_grad=True)
    out = pos
    for _ in range(4):
        out = step(out)
    expected = torch.autograd.grad((out**2).sum(), (pos, w))
    for policy in ("save-last", "nothing-saveable", "dots-saveable"):
        with pytest.raises(remat.RematError, match="as an argument"):
            y = remat.sequential([step] * 4, pos, segments=2, policy=policy)
            torch.autograd.grad((y**2).sum(), (pos, w))
        region = remat.remat(step_of, policy=policy)
        y = pos
        for _ in range(4):
            y = region(y, w)
        assert_close_each(torch.autograd.grad((y**2).sum(), (pos, w)), expected)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save:h", "save-last"])
def test_region_that_runs_torch_func_grad_inside_under_grad(policy: str) -> None:
    # An inner torch.func.grad (a score) inside a region differentiated by an outer grad.
    w = torch.randn(4, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w), "h")
        g = grad(lambda v: (v @ w).sin().sum())(h)
        return (g * h).sum()

    tree_close(grad(remat.remat(f, policy=policy), argnums=1)(x, w), grad(f, argnums=1)(x, w))
