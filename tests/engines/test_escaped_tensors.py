"""Tensors that leave a region other than through its return value get their gradient.

A forward hook appending a submodule's output to a list (Hugging Face's
``output_router_logits`` / ``output_attentions`` capture), an attribute
(``self.last = h``) and a global list: a loss term on such a tensor must get
exactly the gradient it gets without remat, under both engines and every
torch.func transform (NOTE [ Escaped tensors ] in ``remat/_remat/_engines/escapes.py``).
"""

from __future__ import annotations

import copy
import re
import weakref
from collections.abc import Callable
from typing import Any

import optree
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
from torch.func import functional_call

import remat

#: What a global-list region appends to (cleared by each loss).
CAPTURED: list[torch.Tensor] = []


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(3, 4, dtype=torch.double), torch.randn(4, 4, dtype=torch.double)


def to_global(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    CAPTURED.append(h)
    return (h * 2).sin()


def global_loss(region: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        CAPTURED.clear()
        out = region(x, w).sum() + (CAPTURED[0] ** 2).sum()
        CAPTURED.clear()
        return out

    return loss


class Block(nn.Module):
    """A block whose inner projection a forward hook records, as HF's OutputRecorder does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4).double()
        self.out = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(self.proj(x)), "hidden")
        return self.out(h).sin()


class KeepsLast(Block):
    """Stores an intermediate, not detached, on itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(self.proj(x)), "hidden")
        self.last = h * 3
        return self.out(h).sin()


def hooked(block: Block, store: list[torch.Tensor]) -> Block:
    block.proj.register_forward_hook(lambda mod, args, out: store.append(out))
    return block


def module_loss(model: Block, store: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        store.clear()
        y = functional_call(model, params, (x,))
        side = store[0] if store else model.last
        out = y.sum() + (side**2).sum()
        store.clear()
        return out

    return loss


# -- a global list, both engines, several policies ----------------------------------------


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_global_list_gets_its_gradient(engine: Any, policy: str) -> None:
    x, w = inputs()
    expected = engine.grads(global_loss(to_global), x, w)
    actual = engine.grads(global_loss(engine.remat(to_global, policy=policy)), x, w)
    assert_close_all(actual, expected)


def test_escape_costs_no_extra_recompute() -> None:
    # Forward once, recompute once: capturing the escaped tensor again rides on the
    # recompute the backward makes anyway.
    x, w = inputs()
    region = remat.remat(to_global, policy="nothing-saveable")
    with OpCounter() as counter:
        torch.func.grad(global_loss(region), argnums=(0, 1))(x, w)
    assert counter.counts["tanh"] == 2
    saved = remat.remat(to_global, policy="save:hidden")
    with OpCounter() as counter:
        torch.func.grad(global_loss(saved), argnums=(0, 1))(x, w)
    assert counter.counts["tanh"] == 1  # the named value is replayed, not recomputed


# -- hooks and attributes on modules, through functional_call -------------------------------


@pytest.mark.parametrize("policy", CORE_POLICIES)
@pytest.mark.parametrize("kind", ["hook", "attribute"])
def test_module_escapes_under_functional_call(policy: str, kind: str) -> None:
    torch.manual_seed(0)
    store: list[torch.Tensor] = []
    plain = hooked(Block(), store) if kind == "hook" else KeepsLast()
    wrapped = remat.wrap(copy.deepcopy(plain), policy=policy)
    params = dict(plain.named_parameters())
    x = torch.randn(5, 4, dtype=torch.double)
    expected = torch.func.grad(module_loss(plain, store))(params, x)
    actual = torch.func.grad(module_loss(wrapped, store))(params, x)
    assert expected["proj.weight"].abs().sum() > 0
    assert_close_all(list(actual.values()), list(expected.values()))


@pytest.mark.parametrize("policy", CORE_POLICIES)
@pytest.mark.parametrize("kind", ["hook", "attribute"])
def test_module_escapes_eager_backward(engine: Any, kind: str, policy: str) -> None:
    torch.manual_seed(0)
    store: list[torch.Tensor] = []
    plain = hooked(Block(), store) if kind == "hook" else KeepsLast()
    wrapped = copy.deepcopy(plain)
    # engine= forced: under plain autograd "functional" runs the Function itself.
    region = remat.remat(wrapped.forward, policy=policy, engine=engine.name)
    x = torch.randn(5, 4, dtype=torch.double)

    def run(fn: Callable[..., torch.Tensor], model: Block) -> tuple[torch.Tensor, ...]:
        store.clear()
        y = fn(x)
        side = store[0] if store else model.last
        return torch.autograd.grad(y.sum() + (side**2).sum(), list(model.parameters()))

    assert_close_all(run(region, wrapped), run(plain, plain))


# -- every transform --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_escape_under_vjp_jacrev_jacfwd_vmap(policy: str) -> None:
    x, w = inputs()
    loss, region_loss = global_loss(to_global), global_loss(remat.remat(to_global, policy=policy))
    out, pull = torch.func.vjp(loss, x, w)
    out_r, pull_r = torch.func.vjp(region_loss, x, w)
    torch.testing.assert_close(out_r, out)
    assert_close_all(pull_r(torch.ones(())), pull(torch.ones(())))
    assert_close_all(
        torch.func.jacrev(region_loss, argnums=(0, 1))(x, w),
        torch.func.jacrev(loss, argnums=(0, 1))(x, w),
    )
    xs = torch.randn(2, 3, 4, dtype=torch.double)
    batched = torch.func.vmap(torch.func.grad(region_loss, argnums=(0, 1)), in_dims=(0, None))
    reference = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None))
    assert_close_all(batched(xs, w), reference(xs, w))


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_escape_under_second_order_and_eager_backward_of_forced_engine(policy: str) -> None:
    x, w = inputs()
    loss, region_loss = global_loss(to_global), global_loss(remat.remat(to_global, policy=policy))

    def grad_grad(f: Callable[..., torch.Tensor]) -> torch.Tensor:
        inner = torch.func.grad(f, argnums=1)
        return torch.func.grad(lambda w: inner(x, w).sum())(w)

    torch.testing.assert_close(grad_grad(region_loss), grad_grad(loss))
    # engine="functional" under plain autograd: the Function's own backward.
    forced = global_loss(remat.remat(to_global, policy=policy, engine="functional"))
    leaves = (x.clone().requires_grad_(), w.clone().requires_grad_())
    assert_close_all(
        torch.autograd.grad(forced(*leaves), leaves), torch.autograd.grad(loss(*leaves), leaves)
    )


def returned_instead(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`to_global` with the fix the refusal names: the tensor returned, not stored."""
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    return (h * 2).sin(), h


def returned_loss(region: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out, h = region(x, w)
        return out.sum() + (h**2).sum()

    return loss


FORWARD_MODE: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "jvp": lambda f: lambda x, w: torch.func.jvp(f, (x, w), (x.cos(), w.sin())),
    "jacfwd": lambda f: torch.func.jacfwd(f, argnums=(0, 1)),
    "hessian": lambda f: torch.func.hessian(f, argnums=1),
}


# NOTE [ Escaped tensors ] rule 7: the jvp rule recomputes inside the forward.
@pytest.mark.parametrize("policy", CORE_POLICIES)
@pytest.mark.parametrize("transform", list(FORWARD_MODE))
def test_escape_under_forward_mode_is_refused_and_returning_it_works(
    policy: str, transform: str
) -> None:
    x, w = inputs()
    run = FORWARD_MODE[transform]
    with pytest.raises(remat.RematError, match=r"to_global \(.*test_escaped_tensors.py:\d+\)"
                       r".*forward mode.*Return the tensor from the function"):
        run(global_loss(remat.remat(to_global, policy=policy)))(x, w)
    # The fix: return it. Exact, and the region is recomputed (not run plainly).
    expected = run(returned_loss(returned_instead))(x, w)
    with OpCounter() as counter:
        actual = run(returned_loss(remat.remat(returned_instead, policy=policy)))(x, w)
    optree.tree_map(torch.testing.assert_close, actual, expected)
    with OpCounter() as plain:
        run(returned_loss(returned_instead))(x, w)
    assert counter.counts["tanh"] > plain.counts["tanh"], (counter.counts, plain.counts)


def returned_too(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    CAPTURED.append(h)
    return h


def view_returned(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    CAPTURED.append(h)  # its view is the output: the view holds its impl
    return h[1:]


def view_kept(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    g = h.exp()
    CAPTURED.extend([h, h[0], g])
    return (g * h).sin()


@pytest.mark.parametrize("policy", CORE_POLICIES)
@pytest.mark.parametrize("fn", [returned_too, view_returned, view_kept])
def test_escapes_that_alias_outputs_or_each_other(policy: str, fn: Callable[..., Any]) -> None:
    x, w = inputs()

    def loss(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            CAPTURED.clear()
            out = f(x, w).sum() + sum((t**2).sum() for t in CAPTURED)
            CAPTURED.clear()
            return out

        return run

    expected = torch.func.grad(loss(fn), argnums=(0, 1))(x, w)
    actual = torch.func.grad(loss(remat.remat(fn, policy=policy)), argnums=(0, 1))(x, w)
    assert_close_all(actual, expected)


# -- what needs no gradient keeps working -----------------------------------------------------


class Logs(Block):
    """Stores a detached copy, one made under no_grad, and an integer tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        self.detached = h.detach()
        with torch.no_grad():
            self.quiet = h * 2
        self.top = h.argmax(-1)
        return self.out(h).sin()


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_detached_and_integer_escapes_stay_as_they_are(policy: str) -> None:
    torch.manual_seed(0)
    plain = Logs()
    wrapped = remat.wrap(copy.deepcopy(plain), policy=policy)
    params = dict(plain.named_parameters())
    x = torch.randn(5, 4, dtype=torch.double)

    def loss(model: Logs) -> Callable[..., torch.Tensor]:
        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            y = functional_call(model, p, (x,))
            return y.sum() + (model.detached**2).sum() + model.top.sum()

        return f

    expected = torch.func.grad(loss(plain))(params)
    actual = torch.func.grad(loss(wrapped))(params)
    assert_close_all(list(actual.values()), list(expected.values()))
    with torch.no_grad():
        h = torch.tanh(plain.proj(x))
    torch.testing.assert_close(wrapped.detached, h)
    torch.testing.assert_close(wrapped.quiet, h * 2)
    assert torch.equal(wrapped.top, h.argmax(-1))
    assert not wrapped.detached.requires_grad


# -- loud where the tensor cannot be handed back -----------------------------------------------

WATCHED: list[Any] = []


def weakly_watched(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    CAPTURED.append(h)
    WATCHED.append(weakref.ref(h))  # a weak reference: the swap is refused
    return (h * 2).sin()


def returns_it(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.tanh(x @ w)
    return (h * 2).sin(), h


def test_escape_that_cannot_be_swapped_raises_with_a_working_fix() -> None:
    x, w = inputs()
    region = remat.remat(weakly_watched)
    with pytest.raises(remat.RematError) as info:
        torch.func.grad(global_loss(region), argnums=(0, 1))(x, w)
    message = str(info.value)
    assert "weakly_watched" in message and "test_escaped_tensors.py" in message
    assert "shape (3, 4)" in message and "tanh" in message
    assert "Return the tensor" in message
    WATCHED.clear()

    # The fix the message gives: return the tensor from the function.
    fixed = remat.remat(returns_it)

    def fixed_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y, h = fixed(x, w)
        return y.sum() + (h**2).sum()

    expected = torch.func.grad(global_loss(to_global), argnums=(0, 1))(x, w)
    assert_close_all(torch.func.grad(fixed_loss, argnums=(0, 1))(x, w), expected)


@pytest.mark.parametrize("inner_policy", ["nothing-saveable", "dots-saveable"])
@pytest.mark.parametrize("outer_policy", ["nothing-saveable", "dots-saveable"])
def test_nested_regions_with_escapes_raise_with_a_working_fix(
    inner_policy: str, outer_policy: str
) -> None:
    x, w = inputs()
    expected = torch.func.grad(nested_escape_loss(escape_inner, escape_outer), argnums=(0, 1))(x, w)
    run_inner = remat.remat(escape_inner, policy=inner_policy)
    run_outer = remat.remat(escape_outer, policy=outer_policy, static_argnums=(2,))
    with pytest.raises(remat.RematError) as info:
        torch.func.grad(nested_escape_loss(run_inner, run_outer), argnums=(0, 1))(x, w)
    assert re.search(r"escape_(inner|outer) \(.*helpers.py:\d+\)", str(info.value))
    assert "remat only one of them" in str(info.value)
    # The fix the message gives: either region alone is exact.
    for pair in ((run_inner, escape_outer), (escape_inner, run_outer)):
        assert_close_all(torch.func.grad(nested_escape_loss(*pair), argnums=(0, 1))(x, w), expected)


# -- Hugging Face: Mixtral's router logits ------------------------------------------------------


def mixtral(use_cache: bool) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, output_router_logits=True,
        router_aux_loss_coef=1.0, use_cache=use_cache,
    )
    torch.manual_seed(0)
    plain = transformers.MixtralForCausalLM(cfg)
    layer = type(plain.model.layers[0])
    wrapped = remat.apply(copy.deepcopy(plain), policy="nothing-saveable", where=layer)
    return plain, wrapped, torch.randint(0, 64, (2, 8))


def aux_loss(model: nn.Module, ids: torch.Tensor) -> Callable[..., torch.Tensor]:
    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, p, (ids,), {"labels": ids}).aux_loss

    return f


def test_mixtral_kv_cache_in_training_raises_with_a_working_fix() -> None:
    # The cache a layer fills in its forward holds more in the recompute: loud.
    plain, wrapped, ids = mixtral(use_cache=True)
    params = dict(plain.named_parameters())
    with pytest.raises(remat.RematError) as info:
        torch.func.grad(aux_loss(wrapped, ids))(params)
    assert "MixtralDecoderLayer.forward" in str(info.value)
    assert "use_cache=False" in str(info.value)
    # The fix the message gives: no cache in training.
    plain.config.use_cache = wrapped.config.use_cache = False
    expected = torch.func.grad(aux_loss(plain, ids))(params)
    actual = torch.func.grad(aux_loss(wrapped, ids))(params)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-6)


def test_mixtral_router_logits_get_their_gradient() -> None:
    # nothing-saveable: under dots-saveable this router's in-place ``/=`` on topk values
    # makes the recompute run one ``clone`` more than the forward, a loud
    # NondeterministicRecomputeError that does not depend on escapes.
    plain, wrapped, ids = mixtral(use_cache=False)
    params = dict(plain.named_parameters())
    expected = torch.func.grad(aux_loss(plain, ids))(params)
    actual = torch.func.grad(aux_loss(wrapped, ids))(params)
    router = "model.layers.0.mlp.gate.weight"
    assert expected[router].norm() > 1e-3  # the load-balancing loss reaches the router
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_gpt2_output_attentions_get_their_gradient(policy: str) -> None:
    # Attention weights are collected by a hook on GPT2Attention, inside each block;
    # train mode, so dropout (replayed exactly) runs on them too.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    plain = transformers.GPT2Model(cfg)
    wrapped = remat.apply(copy.deepcopy(plain), policy=policy, where=type(plain.h[0]))
    ids = torch.randint(0, 64, (2, 8))

    def loss(model: nn.Module) -> Callable[..., torch.Tensor]:
        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            kwargs = {"output_attentions": True, "use_cache": False}
            out = functional_call(model, p, (ids,), kwargs)
            return out.last_hidden_state.sum() + 100 * sum((a**2).sum() for a in out.attentions)

        return f

    params = dict(plain.named_parameters())
    torch.manual_seed(1)
    expected = torch.func.grad(loss(plain))(params)
    torch.manual_seed(1)
    actual = torch.func.grad(loss(wrapped))(params)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5)
