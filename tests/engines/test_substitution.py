"""The torch.func engine substitutes its views of the tensors ``fn`` reaches per op.

``fn`` runs on the user's own objects: no closure cell, global or module slot
holds anything of remat's while it runs (another thread could read it), and a
tensor that reaches an op where remat cannot substitute it raises.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import CORE_POLICIES
from torch import nn
from torch.func import functional_call, grad, vmap

import remat

D = torch.float64
G = torch.randn(4, 4, dtype=D)


def _body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    return (h @ w).sin().sum()


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_slots_hold_the_users_tensors_while_fn_runs(policy: str) -> None:
    # Deterministic form of the threads test: what another thread would read.
    global G
    x = torch.randn(3, 4, dtype=D)
    lin = nn.Linear(4, 4, dtype=D)
    own = lin.weight  # back in its slot once the caller's reparametrization ends
    seen: list[bool] = []

    def loss(w: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        global G
        G = w
        closed = w * 2
        # By id (ints are no tensors remat would look for): what the caller put there.
        ids = (id(w), id(closed), {id(p["weight"]), id(own)})

        def f(x: torch.Tensor) -> torch.Tensor:
            # Every slot still holds exactly what the caller put there.
            seen.append(
                id(globals()["G"]) == ids[0]
                and id(closed_cell()) == ids[1]
                and id(lin._parameters["weight"]) in ids[2]
            )
            return _body(x, G) + _body(x, closed) + lin(x).pow(2).sum()

        def closed_cell() -> torch.Tensor:
            return closed

        with torch.nn.utils.stateless._reparametrize_module(lin, p):
            return remat.remat(f, policy=policy)(x)  # type: ignore[no-any-return]

    def plain(w: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        return _body(x, w) + _body(x, w * 2) + functional_call(lin, p, (x,)).pow(2).sum()

    w = torch.randn(4, 4, dtype=D)
    p = {k: v.detach() for k, v in lin.named_parameters()}
    try:
        got = grad(loss, argnums=(0, 1))(w, p)
    finally:
        G = torch.randn(4, 4, dtype=D)
    assert seen and all(seen), seen  # forward and every recompute
    expected = grad(plain, argnums=(0, 1))(w, p)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_nested_regions_closing_over_the_same_tensor(policy: str) -> None:
    x = torch.randn(3, 4, dtype=D)

    def run(w: torch.Tensor, use: bool) -> torch.Tensor:
        def inner(h: torch.Tensor) -> torch.Tensor:
            return torch.tanh(h @ w)

        inner_r = remat.remat(inner, policy=policy) if use else inner

        def outer(h: torch.Tensor) -> torch.Tensor:
            return (inner_r(h) @ w).sin()

        return (remat.remat(outer, policy=policy) if use else outer)(x).sum()

    w = torch.randn(4, 4, dtype=D)
    torch.testing.assert_close(grad(run)(w, True), grad(run)(w, False))
    batched = torch.randn(3, 4, 4, dtype=D)
    torch.testing.assert_close(
        vmap(grad(run), in_dims=(0, None))(batched, True),
        vmap(grad(run), in_dims=(0, None))(batched, False),
    )


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_returning_a_closed_over_tensor(policy: str) -> None:
    x = torch.randn(3, 4, dtype=D)

    def run(w: torch.Tensor, use: bool) -> torch.Tensor:
        def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tanh(x @ w), w  # ``w`` itself leaves the region

        y, same = (remat.remat(f, policy=policy) if use else f)(x)
        return (y.sum() + same.pow(3).sum())

    w = torch.randn(4, 4, dtype=D)
    torch.testing.assert_close(grad(run)(w, True), grad(run)(w, False))


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_closed_over_tensor_straight_into_an_inner_transform_raises(policy: str) -> None:
    x = torch.randn(3, 4, dtype=D)

    def score(v: torch.Tensor) -> torch.Tensor:
        return (x @ v).sin().sum()

    def plain(w: torch.Tensor) -> torch.Tensor:
        return (grad(score)(w) * w).sum()

    def closed(w: torch.Tensor) -> torch.Tensor:
        f = remat.remat(lambda: (grad(score)(w) * w).sum(), policy=policy)
        return f()  # type: ignore[no-any-return]

    w = torch.randn(4, 4, dtype=D)
    with pytest.raises(remat.RematError) as caught:
        grad(closed)(w)
    message = str(caught.value)
    assert "test_substitution.py" in message and "closure variable 'w'" in message
    assert "as an argument" in message
    # The fix it gives: pass the tensor as an argument.
    passed = lambda w: remat.remat(plain, policy=policy)(w)  # noqa: E731
    torch.testing.assert_close(grad(passed)(w), grad(plain)(w))


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_tiny_gpt2_under_functional_call(policy: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )
    plain = transformers.GPT2Model(cfg).double()
    wrapped = transformers.GPT2Model(cfg).double()
    wrapped.load_state_dict(plain.state_dict())
    for block in wrapped.h:
        remat.wrap(block, policy=policy)
    ids = torch.randint(0, 64, (2, 8))
    params = {k: v.detach() for k, v in plain.named_parameters()}

    def loss(model: nn.Module) -> Any:
        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            out = functional_call(model, p, (ids,), {"use_cache": False})
            return out.last_hidden_state.pow(2).sum()  # type: ignore[no-any-return]

        return f

    expected, got = grad(loss(plain))(params), grad(loss(wrapped))(params)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key])
    assert all(got[key].abs().sum() > 0 for key in got if key.startswith("h."))
