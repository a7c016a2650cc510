"""Closed-over tensors under torch.func: found and differentiated, or a loud `RematError`."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import remat
from remat._capture.closure import find_closed_over

X = torch.randn(3, 4, dtype=torch.float64)
GLOBAL_W = torch.randn(4, 4, dtype=torch.float64)


def _loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w).pow(2).sum()


def _ref(w: torch.Tensor) -> torch.Tensor:
    return grad(lambda w: _loss(X, w))(w)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_closure_cell(policy: str) -> None:
    w = torch.randn(4, 4, dtype=torch.float64)

    def outer(w: torch.Tensor) -> torch.Tensor:
        return remat.remat(lambda x: _loss(x, w), policy=policy)(X)

    torch.testing.assert_close(grad(outer)(w), _ref(w))


def test_closure_container_and_nested_function() -> None:
    w = torch.randn(4, 4, dtype=torch.float64)

    def outer(w: torch.Tensor) -> torch.Tensor:
        params = {"w": [w]}

        def helper(x: torch.Tensor) -> torch.Tensor:
            return _loss(x, params["w"][0])

        return remat.remat(lambda x: helper(x))(X)

    torch.testing.assert_close(grad(outer)(w), _ref(w))


def _uses_global(x: torch.Tensor) -> torch.Tensor:
    return _loss(x, GLOBAL_W)


def test_global() -> None:
    global GLOBAL_W
    w = torch.randn(4, 4, dtype=torch.float64)

    def outer(w: torch.Tensor) -> torch.Tensor:
        global GLOBAL_W
        old, GLOBAL_W = GLOBAL_W, w
        try:
            return remat.remat(_uses_global)(X)
        finally:
            GLOBAL_W = old

    torch.testing.assert_close(grad(outer)(w), _ref(w))


def test_partial_arguments() -> None:
    w = torch.randn(4, 4, dtype=torch.float64)
    outer = lambda w: remat.remat(functools.partial(_loss, w=w))(X)  # noqa: E731
    torch.testing.assert_close(grad(outer)(w), _ref(w))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.out = nn.Linear(4, 4, dtype=torch.float64)
        self.out.weight = self.lin.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lin(x)))


class Model(nn.Module):
    def __init__(self, use_remat: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.use_remat = use_remat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = remat.remat(block, policy="dots-saveable")(x) if self.use_remat else block(x)
        return x.pow(2).sum()


@pytest.mark.parametrize("per_example", [False, True])
def test_functional_call_gets_every_parameter_gradient(per_example: bool) -> None:
    model = Model(use_remat=False)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, use: bool) -> torch.Tensor:
        model.use_remat = use
        return functional_call(model, p, (x,))  # type: ignore[no-any-return]

    run: Any = grad(loss)
    if per_example:
        run = vmap(run, in_dims=(None, 0, None))
    expected, actual = run(params, X, False), run(params, X, True)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key])
        assert actual[key].abs().sum() > 0


def test_bound_method_of_module() -> None:
    block = Block()
    params = {k: v.detach() for k, v in block.named_parameters()}

    def loss_remat(p: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.nn.utils.stateless._reparametrize_module(block, p, tie_weights=True):
            return remat.remat(block.forward)(X).sum() * 2

    expected = grad(lambda p: functional_call(block, p, (X,)).sum() * 2)(params)
    actual = grad(loss_remat)(params)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key])


class _Holder:
    """Hides tensors where the finder does not look (a ``__slots__`` object)."""

    __slots__ = ("store",)

    def __init__(self) -> None:
        self.store: dict[str, Any] = {}

    def weight(self) -> torch.Tensor:
        return self.store["w"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_hidden_tensor_raises_instead_of_zeros(policy: str) -> None:
    # Under a recording policy the forward pushes its own vjp level, numbered like
    # the outer grad level: the guard must still see the outer wrapper as hidden.
    holder = _Holder()
    wrapped = remat.remat(lambda x: _loss(x, _HOLDER_REF[0].weight()), policy=policy)
    _HOLDER_REF[:] = [holder]

    def outer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        holder.store["w"] = w
        return wrapped(x)

    w = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(remat.RematError, match=r"uses a tensor that is neither an argument"):
        grad(outer)(X, w)  # x only: the hidden w is a wrapper of the same level
    with pytest.raises(remat.RematError, match=r"uses a tensor that is neither an argument"):
        grad(outer, argnums=(0, 1))(X, w)


_HOLDER_REF: list[Any] = []


class _Inner:
    def __init__(self, w: torch.Tensor) -> None:
        self.w = w


class _Outer:
    def __init__(self, w: torch.Tensor) -> None:
        self.inner = _Inner(w)
        self.cfg = {"k": [_Inner(w.cos())]}

    def f(self, x: torch.Tensor) -> torch.Tensor:
        return _loss(x, self.inner.w) + _loss(x, self.cfg["k"][0].w)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_attributes_of_attributes(policy: str) -> None:
    # Was: RematError under nothing-saveable, silently wrong under dots-saveable.
    def run(w: torch.Tensor, use: bool) -> torch.Tensor:
        o = _Outer(w)
        return (remat.remat(o.f, policy=policy) if use else o.f)(X)

    w = torch.randn(4, 4, dtype=torch.float64)
    torch.testing.assert_close(grad(lambda w: run(w, True))(w), grad(lambda w: run(w, False))(w))


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_default_arguments_in_a_loop(policy: str) -> None:
    # ``lambda h, w=w:`` is the usual fix for late binding; the default is an input.
    def run(ws: list[torch.Tensor], use: bool) -> torch.Tensor:
        h = X
        for w in ws:
            f = lambda h, w=w: torch.tanh(h @ w)  # noqa: E731
            h = (remat.remat(f, policy=policy) if use else f)(h)
        return h.sum()

    ws = [torch.randn(4, 4, dtype=torch.float64) for _ in range(3)]
    expected = grad(lambda ws: run(ws, False))(ws)
    for got, want in zip(grad(lambda ws: run(ws, True))(ws), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_closed_over_list_mutated_between_forward_and_backward(policy: str) -> None:
    # Was silently wrong: the recompute read the list as it was at backward time.
    store: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ store[0]) * store[-1].sum()

    def loss(a: torch.Tensor, b: torch.Tensor, fn: Any) -> torch.Tensor:
        store[:] = [a]
        y = fn(X).sum()
        store.append(b)
        return y + fn(X).sum()  # type: ignore[no-any-return]

    a, b = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    g = remat.remat(f, policy=policy)
    actual = grad(lambda a, b: loss(a, b, g), argnums=(0, 1))(a, b)
    expected = grad(lambda a, b: loss(a, b, f), argnums=(0, 1))(a, b)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_finder_names_what_it_found() -> None:
    w = torch.randn(2, requires_grad=True)
    block = Block()
    found = find_closed_over(lambda: (w, block))
    assert any("closure variable 'w'" in name for name in found.names)
    assert any("lin.weight" in name for name in found.names)
    assert len(found.tensors) == 1 + 3  # w, shared weight, two biases


def test_untracked_constants_are_not_inputs() -> None:
    const = torch.randn(2)
    assert find_closed_over(lambda: const).tensors == []
