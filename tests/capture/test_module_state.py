"""Module state changes once per real forward, as without remat.

Buffers (batch norm running stats, spectral norm's power iteration), registered
stateful modules and plain attributes a forward stores: the recompute must not
update them again, and a wrapped model trains step for step like the plain one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import (
    MODULE_POLICIES,
    assert_close_all,
    batch84,
    train_both,
)
from torch import nn
from torch.func import functional_call

import remat
from remat._modules import is_wrapped


def _bn_net(**bn: Any) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(
        nn.Linear(4, 5),
        nn.BatchNorm1d(5, **bn),
        nn.Tanh(),
        nn.Linear(5, 4),
        nn.BatchNorm1d(4, **bn),
    )


BN_VARIANTS = {
    "default": {},
    "cumulative": {"momentum": None},
    "no-running-stats": {"track_running_stats": False},
    "no-affine": {"affine": False, "momentum": None},
}


@pytest.mark.parametrize("variant", list(BN_VARIANTS))
@pytest.mark.parametrize("policy", MODULE_POLICIES)
def test_batchnorm_wrap_trains_like_plain(variant: str, policy: str) -> None:
    train_both(
        _bn_net(**BN_VARIANTS[variant]),
        lambda m: remat.wrap(m, policy=policy),
        eval_between=True,
    )


@pytest.mark.parametrize("variant", list(BN_VARIANTS))
@pytest.mark.parametrize("segments", [1, 2, 3, 5])
@pytest.mark.parametrize("policy", ["save-last", "nothing-saveable"])
def test_batchnorm_sequential_trains_like_plain(variant: str, segments: int, policy: str) -> None:
    train_both(
        _bn_net(**BN_VARIANTS[variant]),
        lambda m: m,
        call=lambda m, x: (
            remat.sequential(m, x, segments=segments, policy=policy)
            if torch.is_grad_enabled()
            else m(x)
        ),
        eval_between=True,
    )


def test_batchnorm_in_eval_mode_while_training_other_layers() -> None:
    def build() -> nn.Module:
        net = _bn_net(momentum=None)()
        net[1].eval()
        return net

    train_both(build, lambda m: remat.apply(m, where=nn.Sequential, policy="nothing-saveable"))


def test_syncbatchnorm_single_process() -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 5), nn.SyncBatchNorm(5, momentum=None), nn.Linear(5, 4))

    train_both(build, lambda m: remat.wrap(m), eval_between=True)


@pytest.mark.parametrize("policy", ["nothing-saveable", "save-last"])
def test_instancenorm_with_running_stats(policy: str) -> None:
    def build() -> nn.Module:
        return nn.Sequential(
            nn.Conv1d(3, 4, 3, padding=1),
            nn.InstanceNorm1d(4, affine=True, track_running_stats=True, momentum=None),
            nn.Conv1d(4, 3, 1),
        )

    train_both(build, lambda m: remat.wrap(m, policy=policy), shape=(2, 3, 7), eval_between=True)


@remat.register_stateful
class Scaler(nn.Module):
    """Output depends on a buffer the forward advances (a schedule, a step counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x * self.count.clone()).sin()
        self.count.add_(0.5)
        return y


def _scaler_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), Scaler(), nn.Linear(4, 4))


@pytest.mark.parametrize("policy", MODULE_POLICIES)
def test_registered_stateful_module_trains_like_plain(policy: str) -> None:
    train_both(_scaler_net, lambda m: remat.wrap(m, policy=policy), eval_between=True)


@pytest.mark.parametrize("segments", [1, 2, 3])
def test_registered_stateful_module_in_sequential(segments: int) -> None:
    train_both(
        _scaler_net,
        lambda m: m,
        call=lambda m, x: remat.sequential(m, x, segments=segments, policy="nothing-saveable"),
    )


@pytest.mark.parametrize("outer", ["wrap", "sequential"])
def test_nested_wrapped_stateful_module(outer: str) -> None:
    def prepare(m: nn.Module) -> nn.Module:
        remat.wrap(m[1], policy="nothing-saveable")
        return remat.wrap(m, policy="nothing-saveable") if outer == "wrap" else m

    def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if outer == "sequential" and is_wrapped(m[1]):
            return remat.sequential(m, x, policy="nothing-saveable")
        return m(x)

    train_both(_scaler_net, prepare, call=call, steps=1)


def test_nested_wrapped_batchnorm_updates_once() -> None:
    # BatchNorm's train-mode output does not read its running stats, so the
    # nesting bug above leaves it right: statistics update once, gradients match.
    def prepare(m: nn.Module) -> nn.Module:
        remat.wrap(m[1])
        remat.wrap(m[4], policy="save-last")
        return remat.wrap(m)

    train_both(_bn_net(momentum=None), prepare, eval_between=True)


@pytest.mark.parametrize("how", ["closure", "argument"])
def test_remat_of_a_function_running_batchnorm_updates_once(how: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, momentum=None))
    x = torch.randn(4, 3)
    if how == "closure":
        out = remat.remat(lambda x: net(x).tanh())(x)
    else:
        out = remat.remat(lambda model, x: model(x).tanh())(net, x)
    out.sum().backward()
    assert int(net[1].num_batches_tracked) == 1


def test_stateful_module_called_twice_before_backward() -> None:
    # BatchNorm's buffers change in each forward: that is state, not a mutation.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()).double()
    wrapped = remat.wrap(copy.deepcopy(net))
    a, b = batch84(), batch84() * 2
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
    a, b = batch84(), batch84() * 2
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
    torch.func.grad(lambda p: functional_call(module, p, (batch84(),)))(params)
    with torch.no_grad():  # what the forward stored, not the zeros from before
        torch.testing.assert_close(module.last, module.lin(batch84()).tanh())


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
    expected = torch.autograd.grad(plain(batch84()).pow(2).sum(), list(plain.parameters()))
    actual = torch.autograd.grad(wrapped(batch84()).pow(2).sum(), list(wrapped.parameters()))
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
        out = module(batch84()).sum()
        return out + module(batch84() * 2).sum() if twice else out

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
        out = module(batch84()).pow(2).sum()
        return out + module(batch84() * 2).pow(2).sum() if twice else out

    expected = torch.autograd.grad(loss(plain), list(plain.parameters()))
    actual = torch.autograd.grad(loss(wrapped), list(wrapped.parameters()))
    assert_close_all(actual, expected)
    for (name, a), (_, b) in zip(plain.named_buffers(), wrapped.named_buffers(), strict=True):
        torch.testing.assert_close(b, a, msg=name)  # updated once per real forward


class CallsForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.bn = nn.BatchNorm1d(4).double()

    def part(self, h: torch.Tensor) -> torch.Tensor:
        return self.bn.forward(self.lin(h)).tanh()  # .forward: no module hook fires


def test_a_stateful_child_called_through_forward_updates_once() -> None:
    module = CallsForward()
    remat.remat(module.part)(batch84()).pow(2).sum().backward()
    assert int(module.bn.num_batches_tracked) == 1
