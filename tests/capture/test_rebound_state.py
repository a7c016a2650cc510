"""A tensor the region reads from a global or a dict, rebound (not written in place)
between the forward and the recompute.

The guarantee (DESIGN §1, "What remat guarantees") is the gradient of the forward
that ran, or a `remat.RematError`. The torch.func engine passes such tensors to its
`autograd.Function` as explicit inputs, so its recompute reads what the forward
read. The eager engine keeps the tensors it finds outside the region and, in the
recompute, refuses one that the binding now gives as a different tensor (a
rebinding is not a write: no version counter catches it); the fixes it names work.
A region without an op log (`nothing-saveable`) that rebinds the entry itself during
its forward leaves the old tensor unreferenced, like an op's internal output (layer
norm's statistics); the recompute then finds its tensor for that slot still bound
outside the region, and refuses.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from conftest import Engine

import remat

W0 = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.double)
W1 = torch.tensor([3.0, 1.0, -0.5, 1.5], dtype=torch.double)

STATE: dict[str, torch.Tensor] = {}
G = W0


def _reads_dict(x: torch.Tensor) -> torch.Tensor:
    return (x * STATE["w"]).sin()


def _rebinds_dict_inside(x: torch.Tensor) -> torch.Tensor:
    y = (x * STATE["w"]).sin()
    STATE["w"] = W1.clone()  # a cache updated by the forward
    return y


def _reads_global(x: torch.Tensor) -> torch.Tensor:
    return (x * G).sin()


def _reset() -> None:
    global G
    STATE["w"], G = W0.clone(), W0.clone()


def _rebind() -> None:
    global G
    STATE["w"], G = W1.clone(), W1.clone()


CASES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "dict entry rebound inside the forward": (_rebinds_dict_inside, False),
    "dict entry rebound before backward": (_reads_dict, True),
    "global rebound before backward": (_reads_global, True),
}


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
@pytest.mark.parametrize("case", list(CASES))
def test_rebound_state_gives_the_forwards_gradient_or_raises(
    engine: Engine, case: str, policy: str
) -> None:
    fn, rebind_after = CASES[case]
    x = torch.tensor([0.3, -0.7, 1.1, 0.9], dtype=torch.double, requires_grad=True)
    _reset()
    (want,) = torch.autograd.grad(fn(x).sum(), x)
    _reset()
    y = remat.remat(fn, policy=policy, engine=engine.name)(x)
    if rebind_after:
        _rebind()
    try:
        (got,) = torch.autograd.grad(y.sum(), x)
    except remat.RematError as e:
        assert engine.name == "eager", e  # the torch.func engine reads the forward's tensor
        message = str(e)
        # At the recompute's start (NOTE [ Bindings the recompute reads ]), or, for a
        # binding that walk does not reach, where the recompute meets the saved tensor.
        assert re.search(
            rf"the recompute of {fn.__name__} \(.*\) reads .*another tensor than the "
            rf"forward read|was rebound after the forward pass of {fn.__name__}",
            message,
        ), message
        assert "policy='everything-saveable'" in message
        # The fixes it names work: everything-saveable, or rebinding after backward.
        _reset()
        y = remat.remat(fn, policy="everything-saveable", engine=engine.name)(x)
        if rebind_after:
            _rebind()
        torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], want)
        if rebind_after:
            _reset()
            y = remat.remat(fn, policy=policy, engine=engine.name)(x)
            (got,) = torch.autograd.grad(y.sum(), x)
            _rebind()
            torch.testing.assert_close(got, want)
        return
    assert engine.name == "functional", "the eager engine must refuse a rebound tensor"
    torch.testing.assert_close(got, want)


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", W0.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sin()


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
@pytest.mark.parametrize("how", ["module", "closure"])
def test_a_module_buffer_rebound_before_backward_gives_the_forwards_gradient(
    engine: Engine, policy: str, how: str
) -> None:
    # Module state is the module state guard's: the recompute reads the buffer the
    # forward read (no refusal needed, unlike a global or a dict entry above).
    module = _Scaled()
    x = torch.tensor([0.3, -0.7, 1.1, 0.9], dtype=torch.double, requires_grad=True)
    (want,) = torch.autograd.grad(module(x).sum(), x)
    fn = module if how == "module" else (lambda h: module(h))
    y = remat.remat(fn, policy=policy, engine=engine.name)(x)
    module.w = W1.clone()
    (got,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(got, want)
