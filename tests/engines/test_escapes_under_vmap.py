"""Escaped tensors of a region that runs under ``vmap`` get exactly their gradient.

Under ``vmap`` the torch.func engine runs the region through its own vmap rule: a
twin call whose function is ``vmap(fn)`` of the physical inputs (NOTE [ The
functional engine ] rule 10). A tensor the region hands out other than through
its return value (a global list, a forward hook) is made inside that inner
``vmap``; it must reach the user's object as a tensor of the user's levels, with
its gradient, under every composition (NOTE [ Escaped tensors ] rule 6).
"""

from __future__ import annotations

import copy
import re
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import (
    CORE_POLICIES,
    OpCounter,
    assert_close_all,
    escape_inner,
    escape_outer,
    nested_escape_loss,
)
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, vmap

import remat

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: What the regions below append to (cleared by each loss).
STORE: list[torch.Tensor] = []


def batched_escape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    STORE.append(h)
    return (h * 2).sin()


def unbatched_escape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # ``u`` depends on ``w`` only: with ``w`` unbatched it leaves the inner vmap
    # unbatched, and its gradient must not be multiplied by the batch size.
    u = torch.sin(w) * 2
    STORE.append(u)
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    STORE.append(h)
    return (h @ u).cos()


def aliased_escapes(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # An escaped tensor, a view of it, and an output that is a view of it too.
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    STORE.extend([h, h[0]])
    return h[1:].exp()


FUNCTIONS = {f.__name__: f for f in (batched_escape, unbatched_escape, aliased_escapes)}


def loss_of(region: Callable[..., torch.Tensor], calls: int = 1) -> Loss:
    """A scalar of the region's output and of every tensor it let out (weighted apart)."""

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        STORE.clear()
        out = sum(region(x * (k + 1), w).sum() for k in range(calls))
        side = sum((t**2).sum() * (i + 1) for i, t in enumerate(STORE))
        STORE.clear()
        return out + side  # type: ignore[return-value]

    return loss


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    xs = torch.randn(3, 2, 4, dtype=torch.double)  # a batch of 3 of (2, 4)
    return xs, torch.randn(4, 4, dtype=torch.double), torch.randn(3, 4, 4, dtype=torch.double)


def _eager_through_vmap(f: Loss, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaves = (x.clone().requires_grad_(), w.clone().requires_grad_())
    vmap(f, in_dims=(0, None))(*leaves).sum().backward()
    return tuple(t.grad for t in leaves)  # type: ignore[misc]


#: Each composition of a loss with vmap, as a function of (loss, xs, w, ws).
COMPOSITIONS: dict[str, Callable[[Loss, torch.Tensor, torch.Tensor, torch.Tensor], Any]] = {
    "vmap(grad)": lambda f, xs, w, ws: vmap(grad(f, argnums=(0, 1)), in_dims=(0, None))(xs, w),
    "vmap(grad) over w": lambda f, xs, w, ws: vmap(grad(f, argnums=(0, 1)), in_dims=(None, 0))(
        xs[0], ws
    ),
    "grad(vmap)": lambda f, xs, w, ws: grad(
        lambda x, w: vmap(f, in_dims=(0, None))(x, w).sum(), argnums=(0, 1)
    )(xs, w),
    "grad(vmap) at dim 1": lambda f, xs, w, ws: grad(
        lambda x, w: vmap(f, in_dims=(1, None))(x, w).sum(), argnums=(0, 1)
    )(xs.transpose(0, 1).contiguous(), w),
    "jacrev(vmap)": lambda f, xs, w, ws: jacrev(
        lambda x, w: vmap(f, in_dims=(0, None))(x, w), argnums=(0, 1)
    )(xs, w),
    "jacfwd(vmap)": lambda f, xs, w, ws: jacfwd(
        lambda x, w: vmap(f, in_dims=(0, None))(x, w), argnums=(0, 1)
    )(xs, w),
    "vmap(jacfwd)": lambda f, xs, w, ws: vmap(jacfwd(f, argnums=(0, 1)), in_dims=(0, None))(xs, w),
    "vmap(vmap(grad))": lambda f, xs, w, ws: vmap(
        vmap(grad(f, argnums=(0, 1)), in_dims=(0, None)), in_dims=(None, 0)
    )(xs, ws),
    "vmap(grad(grad))": lambda f, xs, w, ws: vmap(
        grad(lambda x, w: grad(f, argnums=1)(x, w).sum(), argnums=(0, 1)), in_dims=(0, None)
    )(xs, w),
    "grad(vmap(grad))": lambda f, xs, w, ws: (
        grad(lambda w: vmap(grad(f, argnums=1), in_dims=(0, None))(xs, w).sum())(w),
    ),
    "hessian(vmap)": lambda f, xs, w, ws: (
        hessian(lambda w: vmap(f, in_dims=(0, None))(xs, w).sum())(w),
    ),
    "vmap(hessian)": lambda f, xs, w, ws: (vmap(hessian(f, argnums=1), in_dims=(0, None))(xs, w),),
    "eager backward through vmap": lambda f, xs, w, ws: _eager_through_vmap(f, xs, w),
}


#: Compositions with a forward-mode level: a tensor let out there is refused.
FORWARD_MODE = {"jacfwd(vmap)", "vmap(jacfwd)", "hessian(vmap)", "vmap(hessian)"}


@pytest.mark.parametrize("policy", CORE_POLICIES)
@pytest.mark.parametrize("composition", list(COMPOSITIONS))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_escape_under_vmap_compositions(name: str, composition: str, policy: str) -> None:
    xs, w, ws = inputs()
    run = COMPOSITIONS[composition]
    region = remat.remat(FUNCTIONS[name], policy=policy)
    if composition in FORWARD_MODE:  # NOTE [ Escaped tensors ] rule 7
        with pytest.raises(remat.RematError, match=rf"{name} \(.*forward mode"):
            run(loss_of(region), xs, w, ws)
        return
    expected = run(loss_of(FUNCTIONS[name]), xs, w, ws)
    actual = run(loss_of(region), xs, w, ws)
    assert sum(float(e.abs().sum()) for e in expected) > 0
    assert_close_all(actual, expected)


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_two_calls_with_escapes_under_vmap(policy: str) -> None:
    # Two calls of one region: each call's escapes go to its own place in the list.
    xs, w, ws = inputs()
    for composition in ("vmap(grad)", "grad(vmap)", "eager backward through vmap"):
        run = COMPOSITIONS[composition]
        expected = run(loss_of(unbatched_escape, calls=2), xs, w, ws)
        region = remat.remat(unbatched_escape, policy=policy)
        assert_close_all(run(loss_of(region, calls=2), xs, w, ws), expected)


def test_escape_under_vmap_costs_no_extra_recompute() -> None:
    # One forward, one recompute (nothing-saveable); the named value is replayed.
    xs, w, ws = inputs()
    for composition in ("vmap(grad)", "grad(vmap)", "eager backward through vmap"):
        run = COMPOSITIONS[composition]
        with OpCounter() as plain:
            run(loss_of(batched_escape), xs, w, ws)
        assert plain.counts["tanh"] == 1
        with OpCounter() as counter:
            run(loss_of(remat.remat(batched_escape, policy="nothing-saveable")), xs, w, ws)
        assert counter.counts["tanh"] == 2, composition
        with OpCounter() as counter:
            run(loss_of(remat.remat(batched_escape, policy="save:hidden")), xs, w, ws)
        assert counter.counts["tanh"] == 1, composition


# -- a forward hook on a module: per-example gradients ---------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4).double()
        self.out = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(self.proj(x)), "hidden")
        return self.out(h).sin()


def _module_loss(model: nn.Module, store: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        store.clear()
        y = functional_call(model, params, (x,))
        out = y.sum() + 10 * (store[0] ** 2).sum()
        store.clear()
        return out

    return loss


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_hooked_module_per_example_gradients(policy: str) -> None:
    torch.manual_seed(0)
    store: list[torch.Tensor] = []
    plain = Block()
    plain.proj.register_forward_hook(lambda mod, args, out: store.append(out))
    wrapped = remat.wrap(copy.deepcopy(plain), policy=policy)
    params = dict(plain.named_parameters())
    xs = torch.randn(3, 5, 4, dtype=torch.double)
    per_example = vmap(grad(_module_loss(plain, store)), in_dims=(None, 0))(params, xs)
    actual = vmap(grad(_module_loss(wrapped, store)), in_dims=(None, 0))(params, xs)
    assert per_example["proj.weight"].abs().sum() > 0
    assert_close_all(list(actual.values()), list(per_example.values()))

    def batch_loss(model: nn.Module) -> Callable[..., torch.Tensor]:
        loss = _module_loss(model, store)
        return lambda p, x: vmap(loss, in_dims=(None, 0))(p, x).sum()

    expected = grad(batch_loss(plain))(params, xs)
    assert_close_all(list(grad(batch_loss(wrapped))(params, xs).values()), list(expected.values()))


# -- loud where the tensor cannot be handed back ---------------------------------------------

WATCHED: list[Any] = []


def weakly_watched(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    STORE.append(h)
    WATCHED.append(weakref.ref(h))  # a weak reference: the swap is refused
    return (h * 2).sin()


def returns_it(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.tanh(x @ w)
    return (h * 2).sin(), h


@pytest.mark.parametrize("composition", ["vmap(grad)", "grad(vmap)"])
def test_unswappable_escape_under_vmap_raises_with_a_working_fix(composition: str) -> None:
    xs, w, ws = inputs()
    run = COMPOSITIONS[composition]
    with pytest.raises(remat.RematError) as info:
        run(loss_of(remat.remat(weakly_watched)), xs, w, ws)
    WATCHED.clear()
    message = str(info.value)
    assert "weakly_watched" in message and "test_escapes_under_vmap.py" in message
    assert "tanh" in message and "Return the tensor" in message

    # The fix the message gives: return the tensor from the function.
    fixed = remat.remat(returns_it)

    def fixed_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y, h = fixed(x, w)
        return y.sum() + (h**2).sum()

    assert_close_all(run(fixed_loss, xs, w, ws), run(loss_of(batched_escape_plain), xs, w, ws))


def batched_escape_plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``weakly_watched`` without the weak reference, and without remat: the reference."""
    h = torch.tanh(x @ w)
    STORE.append(h)
    return (h * 2).sin()


# -- a region with an escape inside another region, under vmap -------------------------------

@pytest.mark.parametrize("composition", ["vmap(grad)", "grad(vmap)", "jacrev(vmap)",
                                         "eager backward through vmap"])
@pytest.mark.parametrize("policies", [("nothing-saveable", "nothing-saveable"),
                                      ("dots-saveable", "nothing-saveable"),
                                      ("nothing-saveable", "dots-saveable")])
def test_nested_regions_with_escapes_under_vmap_raise_with_a_working_fix(
    composition: str, policies: tuple[str, str]
) -> None:
    xs, w, ws = inputs()
    run = COMPOSITIONS[composition]
    expected = run(nested_escape_loss(escape_inner, escape_outer), xs, w, ws)
    run_inner = remat.remat(escape_inner, policy=policies[0])
    run_outer = remat.remat(escape_outer, policy=policies[1], static_argnums=(2,))
    with pytest.raises(remat.RematError) as info:
        run(nested_escape_loss(run_inner, run_outer), xs, w, ws)
    message = str(info.value)
    assert re.search(r"escape_(inner|outer) \(.*helpers.py:\d+\)", message)
    assert "remat only one of them" in message
    # The fix the message gives: either region alone is exact.
    for pair in ((run_inner, escape_outer), (escape_inner, run_outer)):
        assert_close_all(run(nested_escape_loss(*pair), xs, w, ws), expected)


# -- Hugging Face: GPT-2's attentions, collected by a hook, per example -----------------------


@pytest.mark.parametrize("composition", ["vmap(grad)", "grad(vmap)"])
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_gpt2_output_attentions_under_vmap(policy: str, composition: str) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    plain = transformers.GPT2Model(cfg).double()
    wrapped = remat.apply(copy.deepcopy(plain), policy=policy, where=type(plain.h[0]))
    ids = torch.randint(0, 64, (3, 1, 8))  # a batch of 3 examples of (1, 8)

    def loss(model: nn.Module) -> Callable[..., torch.Tensor]:
        def f(p: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
            kwargs = {"output_attentions": True, "use_cache": False}
            out = functional_call(model, p, (ids,), kwargs)
            return out.last_hidden_state.sum() + 100 * sum((a**2).sum() for a in out.attentions)

        return f

    def run(model: nn.Module) -> dict[str, torch.Tensor]:
        f = loss(model)
        if composition == "vmap(grad)":
            return vmap(grad(f), in_dims=(None, 0))(params, ids)  # type: ignore[no-any-return]
        return grad(lambda p, i: vmap(f, in_dims=(None, 0))(p, i).sum())(params, ids)  # type: ignore[no-any-return]

    params = dict(plain.named_parameters())
    with OpCounter() as without:
        expected = run(plain)
    with OpCounter() as counter:
        actual = run(wrapped)
    assert expected["h.0.attn.c_attn.weight"].abs().sum() > 0
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-6, atol=1e-8)
    # The layers were recomputed (nothing-saveable) or their matmuls replayed.
    def matmuls(c: OpCounter) -> int:
        return c.counts["bmm"] + c.counts["mm"] + c.counts["addmm"]

    assert (matmuls(counter) > matmuls(without)) == (policy == "nothing-saveable")
