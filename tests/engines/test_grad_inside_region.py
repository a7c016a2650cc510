"""``torch.autograd.grad`` inside a region with respect to a tensor from outside it.

``p = x0 * 2`` outside, ``torch.autograd.grad(e, x0)`` inside: the path from the
region to ``x0`` runs through its argument ``p``, which the recompute (eager) runs
on detached and the torch.func engine's Function never sees. torch said "appears
to not have been used in the graph", or with ``allow_unused=True`` the recompute
differed and remat blamed nondeterministic control flow (the torch.func engine
returned silently wrong gradients). Now remat raises `RematError` naming that
cause, with fixes that work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import OpCounter, assert_close_each

import remat

#: Regions that run torch.autograd.grad inside: by op, by name, either way round.
GRAD_INSIDE_POLICIES = (
    "nothing-saveable", "dots-saveable", "save:hidden", "everything-except:hidden"
)
Wrap = Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]


def _energy(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(p @ w), "hidden")
    return (h**2).sum()


def outer(x0: torch.Tensor, w: torch.Tensor, wrap: Wrap, allow_unused: bool) -> torch.Tensor:
    p = x0 * 2.0  # computed outside the region

    def block(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        e = _energy(p, w)
        (g,) = torch.autograd.grad(e, x0, create_graph=True, allow_unused=allow_unused)
        if g is None:
            g = torch.zeros_like(p)
        return (g**2).sum()

    return wrap(block)(p, w)


def fixed(x0: torch.Tensor, w: torch.Tensor, wrap: Wrap) -> torch.Tensor:
    """The second fix: the tensor differentiated by is the argument, p is made inside."""

    def block(x0: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        e = _energy(x0 * 2.0, w)
        (g,) = torch.autograd.grad(e, x0, create_graph=True)
        return (g**2).sum()

    return wrap(block)(x0, w)


def _plain(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return f


def _remat(**options: Any) -> Wrap:
    return lambda f: remat.remat(f, **options)


def _eager_grads(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> Any:
    leaves = [x.detach().requires_grad_() for x in xs]
    return torch.autograd.grad(fn(*leaves), leaves)


HOW = ("eager", "functional-backward", "torch.func.grad")


def _run(how: str, program: Callable[..., torch.Tensor], wrap: Wrap, **kw: Any) -> Any:
    x0, w = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), torch.randn(3, 3)
    if how == "torch.func.grad":
        return torch.func.grad(lambda a, b: program(a, b, wrap, **kw), argnums=(0, 1))(x0, w)
    return _eager_grads(lambda a, b: program(a, b, wrap, **kw), x0, w)


def _engine(how: str) -> dict[str, Any]:
    return {"engine": "eager"} if how == "eager" else {"engine": "functional"}


@pytest.mark.parametrize("allow_unused", [False, True])
@pytest.mark.parametrize("policy", GRAD_INSIDE_POLICIES)
@pytest.mark.parametrize("how", HOW)
def test_grad_with_respect_to_outside_tensor_raises(how: str, policy: str,
                                                    allow_unused: bool) -> None:
    torch.manual_seed(0)
    expected = _run(how, outer, _plain, allow_unused=allow_unused)
    torch.manual_seed(0)
    wrap = _remat(policy=policy, **_engine(how))
    with pytest.raises(remat.RematError) as info:
        _run(how, outer, wrap, allow_unused=allow_unused)
    message = str(info.value)
    assert "outer.<locals>.block (" in message and "test_grad_inside_region.py" in message
    assert "nondetermin" not in message.lower()
    assert "calls torch.autograd.grad with respect to a tensor of shape (4, 3)" in message
    assert "through an argument computed from it outside the region" in message
    assert "Use policy='everything-saveable' for this region" in message
    # The first fix: everything-saveable, in every engine.
    torch.manual_seed(0)
    fix = _remat(policy="everything-saveable", **_engine(how))
    assert_close_each(_run(how, outer, fix, allow_unused=allow_unused), expected)


@pytest.mark.parametrize("policy", GRAD_INSIDE_POLICIES)
def test_second_fix_under_eager_backward(policy: str) -> None:
    """The other fix the message gives, for loss.backward() with engine='eager'."""
    torch.manual_seed(0)
    expected = _run("eager", outer, _plain, allow_unused=False)
    torch.manual_seed(0)
    assert_close_each(_run("eager", fixed, _remat(policy=policy, engine="eager")), expected)
    x0 = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)

    def backward_ops(wrap: Wrap) -> int:
        out = fixed(x0, w, wrap)
        with OpCounter() as counter:
            torch.autograd.grad(out, (x0, w))
        return sum(counter.counts.values())

    # The region is recomputed: its backward runs more ops than the plain one.
    assert backward_ops(_remat(policy=policy, engine="eager")) > backward_ops(_plain)


def test_save_last_keeps_everything_and_works() -> None:
    """The most recent save-last region is not recomputed, so the path is never needed."""
    torch.manual_seed(0)
    expected = _run("eager", outer, _plain, allow_unused=False)
    torch.manual_seed(0)
    wrap = _remat(policy="save-last", engine="eager")
    assert_close_each(_run("eager", outer, wrap, allow_unused=False), expected)


@pytest.mark.parametrize("policy", ["dots-saveable", "save:hidden", "everything-except:hidden"])
@pytest.mark.parametrize("how", HOW)
def test_grad_with_respect_to_the_argument_still_works(how: str, policy: str) -> None:
    """Differentiating with respect to the region's own argument is unaffected."""

    def program(x0: torch.Tensor, w: torch.Tensor, wrap: Wrap) -> torch.Tensor:
        def block(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            (g,) = torch.autograd.grad(_energy(p, w), p, create_graph=True)
            return (g**2).sum()

        return wrap(block)(x0 * 2.0, w)

    torch.manual_seed(0)
    expected = _run(how, program, _plain)
    torch.manual_seed(0)
    assert_close_each(_run(how, program, _remat(policy=policy, **_engine(how))), expected)


def mixed(x0: torch.Tensor, w: torch.Tensor, wrap: Wrap) -> torch.Tensor:
    """x0 reaches the region both directly (a closure) and through its argument p."""
    p = x0 * 2.0

    def block(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        e = _energy(p + x0, w)
        (g,) = torch.autograd.grad(e, x0, create_graph=True)
        return (g**2).sum()

    return wrap(block)(p, w)


@pytest.mark.parametrize("policy", GRAD_INSIDE_POLICIES)
@pytest.mark.parametrize("how", HOW)
def test_path_partly_outside_raises(how: str, policy: str) -> None:
    """The recompute would find only the direct path: a different, silent gradient."""
    torch.manual_seed(0)
    expected = _run(how, mixed, _plain)
    torch.manual_seed(0)
    pattern = r"calls torch.autograd.grad with respect to a tensor of shape \(4, 3\)"
    with pytest.raises(remat.RematError, match=pattern):
        _run(how, mixed, _remat(policy=policy, **_engine(how)))
    torch.manual_seed(0)
    fix = _remat(policy="everything-saveable", **_engine(how))
    assert_close_each(_run(how, mixed, fix), expected)


@pytest.mark.parametrize("how", ["functional-backward", "torch.func.grad"])
def test_torch_func_engine_nothing_saveable_says_so(how: str) -> None:
    """Under the torch.func engine, nothing-saveable runs the forward without autograd:
    a torch.autograd.grad inside it (even with respect to its argument) cannot run."""

    def program(x0: torch.Tensor, w: torch.Tensor, wrap: Wrap) -> torch.Tensor:
        def block(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            (g,) = torch.autograd.grad(_energy(p, w), p, create_graph=True)
            return (g**2).sum()

        return wrap(block)(x0 * 2.0, w)

    torch.manual_seed(0)
    expected = _run(how, program, _plain)
    torch.manual_seed(0)
    with pytest.raises(remat.RematError) as info:
        _run(how, program, _remat(policy="nothing-saveable", engine="functional"))
    message = str(info.value)
    assert "program.<locals>.block (" in message
    assert "calls torch.autograd.grad on a value that does not require grad" in message
    assert "Use policy='everything-saveable' for this region" in message
    torch.manual_seed(0)
    fix = _remat(policy="everything-saveable", engine="functional")
    assert_close_each(_run(how, program, fix), expected)


def outer_values(x0: torch.Tensor, w: torch.Tensor, wrap: Wrap) -> torch.Tensor:
    """The inner gradient's values only (no ``create_graph``): its backward packs
    nothing, so only the pre hooks on the arguments' nodes see it ran
    (``eager/argument_nodes.py``). Silent before, in the eager engine's
    ``nothing-saveable`` (the recompute's ``g`` had the direct path alone)."""
    p = x0 * 2.0

    def block(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        e = (remat.checkpoint_name(torch.tanh((p + x0) @ w), "hidden") ** 2).sum()
        (g,) = torch.autograd.grad(e, x0, retain_graph=True)
        return torch.tanh(p @ w) * (g**2).sum()

    return wrap(block)(p, w).sum()


@pytest.mark.parametrize("policy", GRAD_INSIDE_POLICIES)
@pytest.mark.parametrize("how", ["eager", "functional-backward"])
def test_grad_values_with_respect_to_outside_tensor_raise(how: str, policy: str) -> None:
    torch.manual_seed(0)
    expected = _run(how, outer_values, _plain)
    torch.manual_seed(0)
    wrap = _remat(policy=policy, **_engine(how))
    if policy == "everything-except:hidden" and how == "eager":
        # The recompute makes the named tensor alone; what depends on ``g`` is kept.
        assert_close_each(_run(how, outer_values, wrap), expected)
        return
    with pytest.raises(remat.RematError) as info:
        _run(how, outer_values, wrap)
    message = str(info.value)
    assert "calls torch.autograd.grad with respect to a tensor of shape (4, 3)" in message
    assert "outer_values.<locals>.block (" in message
    torch.manual_seed(0)
    fix = _remat(policy="everything-saveable", **_engine(how))
    assert_close_each(_run(how, outer_values, fix), expected)
