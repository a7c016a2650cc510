"""The generator walk is kept per function and walked again when what it read changes.

NOTE [ The generator walk cache ] in ``_replay/generators.py``: a generator bound
after a region's first call (a module attribute, a global, a closure cell, a dict
entry the function reaches) is found on the next call, so the recompute draws the
forward's numbers; an unchanged function is not walked again.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import Engine
from torch import nn

import remat
from remat._replay import generators

_GEN: torch.Generator | None = None


def _x() -> torch.Tensor:
    return torch.randn(4, 3, dtype=torch.double, generator=torch.Generator().manual_seed(1))


def _noisy(h: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    if gen is None:
        return h.sin().tanh()
    return (h.sin() * torch.rand(h.shape, generator=gen, dtype=h.dtype)).tanh()


class _Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.gen: torch.Generator | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _noisy(self.lin(h), self.gen)


def _bound_later(how: str) -> tuple[Callable[..., Any], Callable[[torch.Generator], None]]:
    """A region function without a generator, and how to give it one afterwards."""
    global _GEN
    if how == "module-attribute":
        module = _Module()
        return module, lambda g: setattr(module, "gen", g)
    if how == "global":
        _GEN = None

        def reads_global(h: torch.Tensor) -> torch.Tensor:
            return _noisy(h, _GEN)

        return reads_global, lambda g: globals().__setitem__("_GEN", g)
    if how == "dict-entry":
        table: dict[str, torch.Generator | None] = {"gen": None}
        return (lambda h: _noisy(h, table["gen"])), lambda g: table.__setitem__("gen", g)
    gen: torch.Generator | None = None

    def reads_cell(h: torch.Tensor) -> torch.Tensor:
        return _noisy(h, gen)

    def bind(g: torch.Generator) -> None:
        nonlocal gen
        gen = g

    return reads_cell, bind


def _grad(fn: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(fn(x).pow(2).sum(), x)
    return grad


@pytest.mark.parametrize("how", ["module-attribute", "global", "dict-entry", "closure-cell"])
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_a_generator_bound_after_the_first_call_is_found(
    engine: Engine, how: str, policy: str
) -> None:
    fn, bind = _bound_later(how)
    region = engine.remat(fn, policy=policy)
    torch.testing.assert_close(_grad(region, _x()), _grad(fn, _x()))  # walked: none found
    bind(torch.Generator().manual_seed(11))
    expected = _grad(fn, _x())
    bind(torch.Generator().manual_seed(11))
    # The recompute draws the forward's numbers only if the new generator is found.
    torch.testing.assert_close(_grad(region, _x()), expected)
    assert generators.generators_of(fn) != []


def test_an_unchanged_function_is_walked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _Module()
    region = remat.remat(module, policy="nothing-saveable")
    _grad(region, _x())
    walks: list[object] = []
    original = generators.Walk.into

    def counted(self: generators.Walk, at: int, obj: Any, depth: int) -> None:
        walks.append(obj)
        original(self, at, obj, depth)

    monkeypatch.setattr(generators.Walk, "into", counted)
    _grad(region, _x())
    assert walks == []
    module.gen = torch.Generator()  # a new attribute: walked again
    _grad(region, _x())
    assert walks[0] is module


def _reaching_itself() -> tuple[Callable[..., Any], torch.Generator]:
    table: dict[str, Any] = {"gen": torch.Generator()}

    def fn(h: torch.Tensor) -> torch.Tensor:
        return table["self"] and h.sin()

    table["self"] = fn
    return fn, table["gen"]


def test_a_collected_function_leaves_the_table() -> None:
    # The function reaches itself through a dict in its closure: the kept walk
    # holds no container, so the cycle is garbage as without remat.
    fn, gen = _reaching_itself()
    assert generators.generators_of(fn) == [gen]
    key = id(fn)
    assert key in generators._walks
    del fn
    gc.collect()
    assert key not in generators._walks
