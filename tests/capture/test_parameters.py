"""The recompute uses the parameters the forward used, or raises when it cannot.

Found by review: ``torch.func.functional_call`` puts a module's own tensors back
when it returns, so a recompute in backward read the module's own weights
(wrong gradients in both engines); parameters modified in place between forward
and backward (an optimizer step, a ``.data`` assignment) were recomputed from
the new values without the error plain autograd raises.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from helpers import (
    F64,
    TORCH_FUNC_POLICIES,
    assert_close_all,
    batch84,
    seeded_f64,
    tree_close,
)
from torch import nn
from torch.func import functional_call, grad, jacrev, vjp, vmap

import remat

PARAMETER_POLICIES = ["nothing-saveable", "dots-saveable", "save-last", "everything-except:none"]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def fresh_params(net: nn.Module, requires_grad: bool = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        k: torch.randn_like(v).requires_grad_(requires_grad) for k, v in net.named_parameters()
    }


# -- functional_call: the forward's tensors reach the recompute -------------------


@pytest.mark.parametrize("policy", PARAMETER_POLICIES)
def test_functional_call_then_backward_wrapped(policy: str) -> None:
    net = mlp()
    wrapped = remat.wrap(copy.deepcopy(net), policy=policy)
    params = fresh_params(net)

    def loss(model: nn.Module) -> torch.Tensor:
        return functional_call(model, params, (batch84(),)).pow(2).sum()

    expected = torch.autograd.grad(loss(net), list(params.values()))
    actual = torch.autograd.grad(loss(wrapped), list(params.values()))
    assert_close_all(actual, expected)


GLOBAL_NET = mlp()


@pytest.mark.parametrize("policy", PARAMETER_POLICIES)
def test_functional_call_then_backward_region_naming_a_global_module(policy: str) -> None:
    region = remat.remat(lambda h: GLOBAL_NET(h).pow(2).sum(), policy=policy)

    class Holder(nn.Module):
        def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
            super().__init__()
            self.net = GLOBAL_NET
            self.run = forward

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.run(h)

    params = fresh_params(GLOBAL_NET)
    named = {f"net.{k}": v for k, v in params.items()}
    expected = torch.autograd.grad(
        functional_call(Holder(lambda h: GLOBAL_NET(h).pow(2).sum()), named, (batch84(),)),
        list(params.values()),
    )
    actual = torch.autograd.grad(
        functional_call(Holder(region), named, (batch84(),)), list(params.values())
    )
    assert_close_all(actual, expected)


@pytest.mark.parametrize("policy", PARAMETER_POLICIES)
def test_functional_call_frozen_subset_under_grad(policy: str) -> None:
    net = mlp()
    wrapped = remat.wrap(copy.deepcopy(net), policy=policy)
    frozen = {k: v for k, v in fresh_params(net, requires_grad=False).items() if k.startswith("0.")}
    trained = {k: v for k, v in fresh_params(net).items() if k.startswith("2.")}

    def loss(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        return lambda p: functional_call(model, {**frozen, **p}, (batch84(),)).pow(2).sum()

    assert_close_all(
        list(grad(loss(wrapped))(trained).values()), list(grad(loss(net))(trained).values())
    )


def test_functional_call_ensemble_under_vmap_grad_wrt_input() -> None:
    net = mlp()
    wrapped = remat.wrap(copy.deepcopy(net), policy="dots-saveable")
    ensemble = {k: torch.stack([v.detach(), v.detach() * 2]) for k, v in fresh_params(net).items()}

    h0 = batch84()

    def saliency(model: nn.Module) -> Callable[..., torch.Tensor]:
        def one(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return grad(lambda h: functional_call(model, p, (h,)).sum())(h0)

        return vmap(one)

    torch.testing.assert_close(saliency(wrapped)(ensemble), saliency(net)(ensemble))


def test_rebound_plain_closure_under_vjp() -> None:
    scale = torch.tensor(2.0, dtype=torch.double)

    def f(h: torch.Tensor) -> torch.Tensor:
        return torch.sin(h * scale).sum()

    h = batch84()
    _, expected_fn = vjp(f, h)
    (expected,) = expected_fn(torch.tensor(1.0, dtype=torch.double))
    _, vjp_fn = vjp(remat.remat(f), h)
    scale = torch.tensor(5.0, dtype=torch.double)  # rebound before the backward
    (actual,) = vjp_fn(torch.tensor(1.0, dtype=torch.double))
    torch.testing.assert_close(actual, expected)


# -- parameters modified between forward and backward ------------------------------


class Shifted(nn.Module):
    """A parameter that no op saves: autograd itself would not notice a change."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.randn(4, dtype=torch.double))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h + self.b).sin()


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save:none"])
@pytest.mark.parametrize(
    "model", [lambda: nn.Linear(4, 4).double(), Shifted], ids=["linear", "unsaved"]
)
def test_optimizer_step_before_backward_raises(policy: str, model: Callable[[], nn.Module]) -> None:
    module = remat.wrap(model(), policy=policy)
    out = module(batch84().requires_grad_())
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # what optimizer.step() does
    with pytest.raises(remat.SavedInputMutatedError, match="modified in place after the forward"):
        out.sum().backward()


def test_data_assignment_before_backward_raises() -> None:
    module = remat.wrap(nn.Linear(4, 4).double())
    out = module(batch84().requires_grad_())
    module.weight.data = torch.randn(4, 4, dtype=torch.double)
    with pytest.raises(remat.SavedInputMutatedError, match="'weight' of Linear"):
        out.sum().backward()


def test_new_view_of_the_same_memory_is_left_alone() -> None:
    # FSDP-style: between forward and backward the slot gets a new tensor object
    # over the same memory; nothing changed, so no error and the same gradient.
    net = mlp()
    wrapped = remat.wrap(copy.deepcopy(net))
    h = batch84().requires_grad_()
    out = wrapped(h).sum()
    first = wrapped[0]
    first._parameters["weight"] = nn.Parameter(first.weight.detach())
    (actual,) = torch.autograd.grad(out, h)
    (expected,) = torch.autograd.grad(net(h).sum(), h)
    torch.testing.assert_close(actual, expected)


# -- which modules a region pins: the ones it runs (found by review) -----------------


@pytest.mark.parametrize("change", ["in_place", "data"])
def test_torch_func_parameter_changed_before_the_backward_raises(change: str) -> None:
    net = mlp()
    region = remat.remat(lambda h: net(h).sum())
    _, vjp_fn = vjp(region, batch84())
    weight = net[0].weight
    with torch.no_grad():
        if change == "in_place":
            weight.add_(1.0)
        else:
            weight.data = weight.data + 1.0
    with pytest.raises(remat.SavedInputMutatedError, match="modified in place or reassigned"):
        vjp_fn(torch.tensor(1.0, dtype=torch.double))


# -- found by review of the module watching --------------------------------------------


def test_a_module_that_renormalizes_its_own_weight_in_forward() -> None:
    # nn.Embedding(max_norm=...) writes its weight during the forward: that is
    # the state the forward leaves, not a change before the backward.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 4)).double()
    wrapped = remat.wrap(copy.deepcopy(plain))
    idx = torch.tensor([1, 2, 3, 2])
    expected = torch.autograd.grad(plain(idx).tanh().pow(2).sum(), list(plain.parameters()))
    actual = torch.autograd.grad(wrapped(idx).tanh().pow(2).sum(), list(wrapped.parameters()))
    assert_close_all(actual, expected)


GLOBAL_WEIGHT = nn.Parameter(torch.randn(4, 4, dtype=torch.double))


def test_a_parameter_read_through_a_global_and_saved_as_a_view() -> None:
    region = remat.remat(lambda h: (h @ GLOBAL_WEIGHT.t()).sin())
    out = region(batch84().requires_grad_())
    with torch.no_grad():
        GLOBAL_WEIGHT.mul_(2)  # an optimizer step before backward
    try:
        with pytest.raises(remat.SavedInputMutatedError, match="saved it \\(or a view of it\\)"):
            out.sum().backward()
    finally:
        with torch.no_grad():
            GLOBAL_WEIGHT.div_(2)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5).double()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(remat.checkpoint_name(self.lin(x), "h") * self.scale) @ self.lin.weight


@pytest.mark.parametrize("policy", TORCH_FUNC_POLICIES)
def test_functional_call_with_swapped_buffers(policy: str) -> None:
    torch.manual_seed(0)
    (x,) = seeded_f64((4, 5))
    plain = _Scaled()
    wrapped = _Scaled()
    wrapped.load_state_dict(plain.state_dict())
    remat.wrap(wrapped, policy=policy)
    params = {k: v.detach() for k, v in plain.named_parameters()}
    buffers = {"scale": torch.linspace(-1.0, 2.0, 5, dtype=F64)}  # differs from the module's

    def loss(module: nn.Module) -> Callable[..., torch.Tensor]:
        return lambda p, bufs, x: functional_call(module, (p, bufs), (x,)).pow(2).sum()

    tree_close(
        grad(loss(plain), argnums=(0, 1))(params, buffers, x),
        grad(loss(wrapped), argnums=(0, 1))(params, buffers, x),
    )
    tree_close(
        jacrev(loss(plain), argnums=0)(params, buffers, x),
        jacrev(loss(wrapped), argnums=0)(params, buffers, x),
    )
