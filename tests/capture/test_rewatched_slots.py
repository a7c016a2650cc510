"""A module the guard pinned whole is watched again when its slots hold other tensors.

`StateGuard.saw` skips a module run again with the tensors it watched (the
module pre-hook's fast path); a ``functional_call`` inside the region that puts
other tensors in a pinned submodule's slots must still be watched, so a buffer
the forward writes through it changes once, as without remat (NOTE [ State the
forward changes ] rule 1 in ``_capture/module_state.py``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import Engine
from helpers import RecomputeCounter
from torch import nn
from torch.func import functional_call


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.double))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x.sin() + self.calls  # add saves no tensor: the buffer is read, not kept


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.counter = _Counter()
        self.lin = nn.Linear(3, 3).double()
        self.external = torch.zeros((), dtype=torch.double)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # the counter's own buffer is pinned, never written
        swapped = functional_call(self.counter, {"calls": self.external}, (h,))
        return (h * swapped).tanh()


class _SavingCounter(_Counter):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x.sin() * self.calls  # mul saves the buffer: the recompute meets it saved


class _SavingOuter(_Outer):
    def __init__(self) -> None:
        super().__init__()
        self.counter = _SavingCounter()


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
@pytest.mark.parametrize("outer", [_Outer, _SavingOuter], ids=["added", "saved"])
def test_a_buffer_swapped_in_by_functional_call_is_written_once(
    engine: Engine, policy: str, outer: type[_Outer]
) -> None:
    """``saved``: the forward writes the buffer and autograd saves it, so the recompute
    saves the guard's copy where the forward saved the attribute's tensor: the module
    state guard at work, not a rebinding (it raised "rebound" in the eager engine)."""
    x = torch.randn(4, 3, dtype=torch.double, generator=torch.Generator().manual_seed(0))
    plain, model = outer(), outer()
    model.load_state_dict(plain.state_dict())
    expected = torch.autograd.grad(plain(x.requires_grad_()).sum(), x)[0]
    region = engine.remat(model, policy=policy)
    with RecomputeCounter() as counter:
        actual = torch.autograd.grad(region(x).sum(), x)[0]
    assert counter.counts["sin"] == 1  # the counter ran again
    torch.testing.assert_close(actual, expected)
    assert float(model.external) == float(plain.external) == 1.0  # not 2
    assert float(model.counter.calls) == float(plain.counter.calls) == 0.0
