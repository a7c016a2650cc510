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
from typing import Any

import pytest
import torch
from helpers import assert_close_all
from torch import nn
from torch.func import functional_call, grad, vjp, vmap

import remat

POLICIES = ["nothing-saveable", "dots-saveable", "save-last", "everything-except:none"]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def fresh_params(net: nn.Module, requires_grad: bool = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        k: torch.randn_like(v).requires_grad_(requires_grad) for k, v in net.named_parameters()
    }


def x() -> torch.Tensor:
    torch.manual_seed(2)
    return torch.randn(8, 4, dtype=torch.double)


# -- functional_call: the forward's tensors reach the recompute -------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_functional_call_then_backward_wrapped(policy: str) -> None:
    net = mlp()
    wrapped = remat.wrap(copy.deepcopy(net), policy=policy)
    params = fresh_params(net)

    def loss(model: nn.Module) -> torch.Tensor:
        return functional_call(model, params, (x(),)).pow(2).sum()

    expected = torch.autograd.grad(loss(net), list(params.values()))
    actual = torch.autograd.grad(loss(wrapped), list(params.values()))
    assert_close_all(actual, expected)


GLOBAL_NET = mlp()


@pytest.mark.parametrize("policy", POLICIES)
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
        functional_call(Holder(lambda h: GLOBAL_NET(h).pow(2).sum()), named, (x(),)),
        list(params.values()),
    )
    actual = torch.autograd.grad(
        functional_call(Holder(region), named, (x(),)), list(params.values())
    )
    assert_close_all(actual, expected)


@pytest.mark.parametrize("policy", POLICIES)
def test_functional_call_frozen_subset_under_grad(policy: str) -> None:
    net = mlp()
    wrapped = remat.wrap(copy.deepcopy(net), policy=policy)
    frozen = {k: v for k, v in fresh_params(net, requires_grad=False).items() if k.startswith("0.")}
    trained = {k: v for k, v in fresh_params(net).items() if k.startswith("2.")}

    def loss(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        return lambda p: functional_call(model, {**frozen, **p}, (x(),)).pow(2).sum()

    assert_close_all(
        list(grad(loss(wrapped))(trained).values()), list(grad(loss(net))(trained).values())
    )


def test_functional_call_ensemble_under_vmap_grad_wrt_input() -> None:
    net = mlp()
    wrapped = remat.wrap(copy.deepcopy(net), policy="dots-saveable")
    ensemble = {k: torch.stack([v.detach(), v.detach() * 2]) for k, v in fresh_params(net).items()}

    h0 = x()

    def saliency(model: nn.Module) -> Callable[..., torch.Tensor]:
        def one(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return grad(lambda h: functional_call(model, p, (h,)).sum())(h0)

        return vmap(one)

    torch.testing.assert_close(saliency(wrapped)(ensemble), saliency(net)(ensemble))


def test_rebound_plain_closure_under_vjp() -> None:
    scale = torch.tensor(2.0, dtype=torch.double)

    def f(h: torch.Tensor) -> torch.Tensor:
        return torch.sin(h * scale).sum()

    h = x()
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
    out = module(x().requires_grad_())
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # what optimizer.step() does
    with pytest.raises(remat.SavedInputMutatedError, match="modified in place after the forward"):
        out.sum().backward()


def test_data_assignment_before_backward_raises() -> None:
    module = remat.wrap(nn.Linear(4, 4).double())
    out = module(x().requires_grad_())
    module.weight.data = torch.randn(4, 4, dtype=torch.double)
    with pytest.raises(remat.SavedInputMutatedError, match="'weight' of Linear"):
        out.sum().backward()


def test_new_view_of_the_same_memory_is_left_alone() -> None:
    # FSDP-style: between forward and backward the slot gets a new tensor object
    # over the same memory; nothing changed, so no error and the same gradient.
    net = mlp()
    wrapped = remat.wrap(copy.deepcopy(net))
    h = x().requires_grad_()
    out = wrapped(h).sum()
    first = wrapped[0]
    first._parameters["weight"] = nn.Parameter(first.weight.detach())
    (actual,) = torch.autograd.grad(out, h)
    (expected,) = torch.autograd.grad(net(h).sum(), h)
    torch.testing.assert_close(actual, expected)


def test_stateful_module_called_twice_before_backward() -> None:
    # BatchNorm's buffers change in each forward: that is state, not a mutation.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()).double()
    wrapped = remat.wrap(copy.deepcopy(net))
    a, b = x(), x() * 2
    expected = torch.autograd.grad((net(a) + net(b)).sum(), list(net.parameters()))
    actual = torch.autograd.grad((wrapped(a) + wrapped(b)).sum(), list(wrapped.parameters()))
    assert_close_all(actual, expected)


class PowerIteration(nn.Module):
    """A buffer updated in place by every forward, like spectral norm's ``weight_u``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.double))
        self.register_buffer("u", torch.ones(4, dtype=torch.double))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.u.copy_(torch.nn.functional.normalize(self.w @ self.u, dim=0))
        return (h @ self.w * self.u.clone()).tanh()


@pytest.mark.parametrize("declared", [False, True], ids=["unregistered", "stateful"])
def test_buffer_updated_by_a_second_forward(declared: bool) -> None:
    # A small buffer the forward writes is state without registration: each
    # recompute starts from what its own forward found (NOTE [ State the forward
    # changes ] rule 1), so no cure is needed any more.
    torch.manual_seed(0)
    plain = PowerIteration()
    stateful = copy.deepcopy(plain)
    if declared:
        stateful.remat_stateful = True
    wrapped = remat.wrap(stateful)
    a, b = x(), x() * 2
    expected = torch.autograd.grad((plain(a) + plain(b)).sum(), plain.w)
    actual = torch.autograd.grad((wrapped(a) + wrapped(b)).sum(), wrapped.w)
    assert_close_all(actual, expected)
    torch.testing.assert_close(wrapped.u, plain.u)  # updated once per real forward


class KeepsLast(nn.Module):
    """Stores a plain tensor on itself in forward (for logging or visualisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.last = torch.zeros(8, 4, dtype=torch.double)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.lin(h).tanh()
        self.last = out.detach()
        return out.sum()


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_plain_attribute_stored_in_forward_survives_torch_func(policy: str) -> None:
    module = remat.wrap(KeepsLast(), policy=policy)
    params = dict(module.named_parameters())
    torch.func.grad(lambda p: functional_call(module, p, (x(),)))(params)
    with torch.no_grad():  # what the forward stored, not the zeros from before
        torch.testing.assert_close(module.last, module.lin(x()).tanh())


# -- which modules a region pins: the ones it runs (found by review) -----------------


class Counter(nn.Module):
    """Counts its calls in a buffer that the math does not read."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.register_buffer("calls", torch.zeros((), dtype=torch.double))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(h).tanh()


class PerLayer(nn.Module):
    """A region for layer 0 only, made from a bound method of the whole model."""

    def __init__(self, layers: nn.ModuleList, use_remat: bool) -> None:
        super().__init__()
        self.layers = layers
        self.use_remat = use_remat

    def layer(self, h: torch.Tensor, i: int) -> torch.Tensor:
        return self.layers[i](h).tanh()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        first = remat.remat(self.layer, static_argnums=(1,)) if self.use_remat else self.layer
        return self.layer(first(h, 0), 1)


def test_a_region_pins_only_the_modules_it_runs() -> None:
    # Layer 0's region must not see layer 1's counter, which runs (and counts)
    # outside it: only the modules a region runs are its business.
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(4, 4).double(), Counter()])
    plain, wrapped = PerLayer(copy.deepcopy(layers), False), PerLayer(layers, True)
    expected = torch.autograd.grad(plain(x()).pow(2).sum(), list(plain.parameters()))
    actual = torch.autograd.grad(wrapped(x()).pow(2).sum(), list(wrapped.parameters()))
    assert_close_all(actual, expected)


class Prev(nn.Module):
    """Rebinds its own buffer in forward: the recompute must see the old one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.register_buffer("prev", torch.ones(4, dtype=torch.double))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = (self.lin(h) * self.prev).tanh()
        self.prev = h.detach().mean(0)
        return out


@pytest.mark.parametrize("twice", [False, True])
def test_forward_rebinding_its_own_buffer(twice: bool) -> None:
    torch.manual_seed(0)
    plain = Prev()
    wrapped = remat.wrap(copy.deepcopy(plain))

    def loss(module: nn.Module) -> torch.Tensor:
        out = module(x()).sum()
        return out + module(x() * 2).sum() if twice else out

    expected = torch.autograd.grad(loss(plain), list(plain.parameters()))
    actual = torch.autograd.grad(loss(wrapped), list(wrapped.parameters()))
    assert_close_all(actual, expected)


def _spectral(kind: str) -> nn.Module:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    if kind == "hook":
        lin = torch.nn.utils.spectral_norm(lin)
    else:
        lin = torch.nn.utils.parametrizations.spectral_norm(lin)
    return nn.Sequential(nn.Linear(4, 4).double(), nn.Tanh(), lin)


@pytest.mark.parametrize("kind", ["hook", "parametrization"])
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
@pytest.mark.parametrize("twice", [False, True])
def test_spectral_norm_power_iteration_runs_once(kind: str, policy: str, twice: bool) -> None:
    plain = _spectral(kind)
    wrapped = remat.wrap(copy.deepcopy(plain), policy=policy)

    def loss(module: nn.Module) -> torch.Tensor:
        out = module(x()).pow(2).sum()
        return out + module(x() * 2).pow(2).sum() if twice else out

    expected = torch.autograd.grad(loss(plain), list(plain.parameters()))
    actual = torch.autograd.grad(loss(wrapped), list(wrapped.parameters()))
    assert_close_all(actual, expected)
    for (name, a), (_, b) in zip(plain.named_buffers(), wrapped.named_buffers(), strict=True):
        torch.testing.assert_close(b, a, msg=name)  # updated once per real forward


@pytest.mark.parametrize("change", ["in_place", "data"])
def test_torch_func_parameter_changed_before_the_backward_raises(change: str) -> None:
    net = mlp()
    region = remat.remat(lambda h: net(h).sum())
    _, vjp_fn = vjp(region, x())
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
    out = region(x().requires_grad_())
    with torch.no_grad():
        GLOBAL_WEIGHT.mul_(2)  # an optimizer step before backward
    try:
        with pytest.raises(remat.SavedInputMutatedError, match="saved it \\(or a view of it\\)"):
            out.sum().backward()
    finally:
        with torch.no_grad():
            GLOBAL_WEIGHT.div_(2)


class CallsForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.bn = nn.BatchNorm1d(4).double()

    def part(self, h: torch.Tensor) -> torch.Tensor:
        return self.bn.forward(self.lin(h)).tanh()  # .forward: no module hook fires


def test_a_stateful_child_called_through_forward_updates_once() -> None:
    module = CallsForward()
    remat.remat(module.part)(x()).pow(2).sum().backward()
    assert int(module.bn.num_batches_tracked) == 1


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
    h = x().requires_grad_()
    (expected,) = torch.autograd.grad(plain(h).sin().sum(), h)
    for _ in range(5):
        (actual,) = torch.autograd.grad(region(h).sum(), h)
        torch.testing.assert_close(actual, expected)
    # The watching hook stays registered: a handle per call would change the
    # global hook table torch.compile guards on, and recompile every call.
    assert len(compiles) <= 2
    # Under the region's saved-tensor hooks (never traced) it runs eagerly (docs/modules.md).
    assert not compiles
