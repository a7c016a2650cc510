"""Tensors inside argument objects: found and differentiated by both engines.

Arguments are flattened as pytrees (dataclasses and dict subclasses included); an
argument that is still an object is walked like an object the function reaches.
What neither reaches (a ``__slots__`` object) raises under torch.func, with a fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import pytest
import torch
from helpers import CORE_POLICIES

import remat


class Config:
    """A plain object: tensors in attributes, one in a list, a non-tensor setting."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor) -> None:
        self.w = w
        self.extra = [b]
        self.scale = 0.5


@dataclasses.dataclass
class Params:
    w: torch.Tensor
    b: torch.Tensor
    scale: float = 0.5


def _body(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ w + b), "hidden")
    return ((h @ w) * scale).sin()


def from_object(x: torch.Tensor, cfg: Config) -> torch.Tensor:
    return _body(x, cfg.w, cfg.extra[0], cfg.scale)


def from_dataclass(x: torch.Tensor, p: Params) -> torch.Tensor:
    return _body(x, p.w, p.b, p.scale)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.randn(3, 4, dtype=torch.float64),
        torch.randn(4, 4, dtype=torch.float64),
        torch.randn(4, dtype=torch.float64),
    )


@pytest.mark.parametrize("policy", CORE_POLICIES)
@pytest.mark.parametrize("kind", ["object", "dataclass"])
def test_tensors_in_argument_objects(engine: Any, kind: str, policy: str) -> None:
    fn, box = (from_object, Config) if kind == "object" else (from_dataclass, Params)
    region = engine.remat(fn, policy=policy)

    def loss(f: Any) -> Any:
        return lambda x, w, b: f(x, box(w, b)).pow(2).sum()

    xs = _inputs()
    expected = engine.grads(loss(fn), *xs)
    assert all(bool(g.abs().sum() > 0) for g in expected)
    torch.testing.assert_close(engine.grads(loss(region), *xs), expected)


def _block(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(module(x)).sin()


class Outer(torch.nn.Module):
    """Passes its submodule to a region as an argument (not closed over)."""

    def __init__(self, block: Any) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block(self.lin, x)
        return out


@pytest.mark.parametrize("policy", ("nothing-saveable", "dots-saveable"))
def test_module_passed_as_an_argument(policy: str) -> None:
    plain = Outer(_block)
    rematted = Outer(remat.remat(_block, policy=policy))
    rematted.load_state_dict(plain.state_dict())
    params = {k: v.detach() for k, v in plain.named_parameters()}
    x = torch.randn(3, 4, dtype=torch.float64)

    def loss(model: torch.nn.Module) -> Any:
        def inner(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = torch.func.functional_call(model, p, (x,))
            return out.pow(2).sum()

        return inner

    expected = torch.func.grad(loss(plain), argnums=(0, 1))(params, x)
    torch.testing.assert_close(torch.func.grad(loss(rematted), argnums=(0, 1))(params, x), expected)


class Slotted:
    __slots__ = ("b", "w")

    def __init__(self, w: torch.Tensor, b: torch.Tensor) -> None:
        self.w = w
        self.b = b


def from_slots(x: torch.Tensor, s: Slotted) -> torch.Tensor:
    return _body(x, s.w, s.b, 0.5)


def test_slots_object_raises_with_a_fix_that_works() -> None:
    class Local(Slotted):
        __slots__ = ()

    region = remat.remat(from_slots)

    def loss(f: Any) -> Any:
        return lambda x, w, b: f(x, Local(w, b)).pow(2).sum()

    xs = _inputs()
    grad = torch.func.grad(loss(region), argnums=(0, 1, 2))
    with pytest.raises(remat.RematError) as info:
        grad(*xs)
    message = str(info.value)
    assert "from_slots" in message and "test_argument_objects.py" in message
    assert "namespace='remat'" in message
    optree.register_pytree_node(
        Local, lambda s: ((s.w, s.b), None), lambda _, c: Local(*c), namespace="remat"
    )
    expected = torch.func.grad(loss(from_slots), argnums=(0, 1, 2))(*xs)
    torch.testing.assert_close(grad(*xs), expected)


def test_model_output_argument() -> None:
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import BaseModelOutput

    def head(out: BaseModelOutput, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(out.last_hidden_state @ w).sin()

    region = remat.remat(head, policy="dots-saveable")

    def loss(f: Any) -> Any:
        return lambda h, w: f(BaseModelOutput(last_hidden_state=h.cos()), w).pow(2).sum()

    h, w, _ = _inputs()
    expected = torch.func.grad(loss(head), argnums=(0, 1))(h, w)
    torch.testing.assert_close(torch.func.grad(loss(region), argnums=(0, 1))(h, w), expected)
