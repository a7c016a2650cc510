"""Tied weights given two values by ``functional_call(..., tie_weights=False)``.

After the call ``functional_call`` ties them again, so at the recompute the two
slots hold one tensor while the forward read two. The torch.func engine
substitutes by identity and gave every op the same one, silently (the second
adversarial pass: every gradient off by up to 145, under ``loss.backward()``
and ``torch.func.grad``). It now raises; the fixes it names work.
"""

from __future__ import annotations

import pytest
import torch
from helpers import RecomputeCounter
from torch import nn
from torch.func import functional_call

import remat
from remat._errors import SavedInputMutatedError

D = torch.double
POLICIES = ["nothing-saveable", "dots-saveable"]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(10, 6, dtype=D)
        self.lin = nn.Linear(6, 6, dtype=D)
        self.head = nn.Linear(6, 10, bias=False, dtype=D)
        self.head.weight = self.emb.weight

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(self.emb(i))))


TOKENS = torch.tensor([[1, 2, 3], [4, 5, 6]])


def _params(model: nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    w = model.get_submodule("emb").weight.detach()
    lin = model.get_submodule("lin")
    given = {"emb.weight": w, "lin.weight": lin.weight.detach(), "lin.bias": lin.bias.detach(),
             "head.weight": 2 * w}
    params = {k: v.clone().requires_grad_() for k, v in given.items()}
    if tied:  # one tensor for both names, as ``tie_weights=True`` requires
        params["head.weight"] = params["emb.weight"]
    return params


def _grads(model: nn.Module, tied: bool) -> dict[str, torch.Tensor | None]:
    params = _params(model, tied)
    out = functional_call(model, params, (TOKENS,), tie_weights=tied)
    out.pow(2).sum().backward()
    return {k: v.grad for k, v in params.items()}


def _assert_same(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        assert g is not None and w is not None, k
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("policy", POLICIES)
def test_two_values_for_tied_weights_raise_under_the_torch_func_engine(policy: str) -> None:
    with pytest.raises(SavedInputMutatedError) as caught:
        _grads(remat.wrap(Tied(), policy=policy, engine="functional"), tied=False)
    message = str(caught.value)
    assert "the recompute of Tied.forward" in message and "emb.weight" in message, message
    assert "head.weight" in message and "engine='eager'" in message, message

    # The first fix it names: the eager engine.
    want = _grads(Tied(), tied=False)
    with RecomputeCounter() as counter:
        got = _grads(remat.wrap(Tied(), policy=policy, engine="eager"), tied=False)
    _assert_same(got, want)
    assert counter.counts["tanh"] == 1, counter.counts


@pytest.mark.parametrize("policy", POLICIES)
def test_one_value_for_tied_weights_works_under_the_torch_func_engine(policy: str) -> None:
    """The second fix, ``tie_weights=True``: both slots read one tensor, in the forward too."""
    want = _grads(Tied(), tied=True)
    with RecomputeCounter() as counter:
        got = _grads(remat.wrap(Tied(), policy=policy, engine="functional"), tied=True)
    _assert_same(got, want)
    assert counter.counts["tanh"] == 1, counter.counts


def _func_grads(model: nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in _params(model, tied).items()}
    if tied:  # torch.func wraps each leaf: give one name, functional_call ties the other
        del params["head.weight"]

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, p, (TOKENS,), tie_weights=tied).pow(2).sum()

    grads: dict[str, torch.Tensor] = torch.func.grad(f)(params)
    return grads


@pytest.mark.parametrize("policy", POLICIES)
def test_two_values_for_tied_weights_raise_under_torch_func_grad(policy: str) -> None:
    """Under ``torch.func.grad`` the backward also runs after ``functional_call`` has
    tied the weights again: it raises too, and ``tie_weights=True`` works."""
    with pytest.raises(SavedInputMutatedError, match="holding one tensor"):
        _func_grads(remat.wrap(Tied(), policy=policy), tied=False)
    with RecomputeCounter() as counter:
        got = _func_grads(remat.wrap(Tied(), policy=policy), tied=True)
    _assert_same(dict(got), dict(_func_grads(Tied(), tied=True)))
    assert counter.counts["tanh"] == 1, counter.counts


@pytest.mark.parametrize("policy", POLICIES)
def test_a_slot_the_forward_did_not_read_gives_way(policy: str) -> None:
    """Two dict entries rebound to one tensor, only one read in the forward: the
    recompute gives the op what the read one held (the unread one, walked first,
    used to win and gave a forward that never ran)."""
    torch.manual_seed(0)
    w = torch.randn(3, 4, dtype=D, requires_grad=True)
    table = {"unread": torch.full((4,), 5.0, dtype=D), "read": torch.zeros(4, dtype=D)}

    def region(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w + table["read"])

    x = torch.linspace(-1, 1, 6, dtype=D).reshape(2, 3)
    (want,) = torch.autograd.grad(region(x).pow(2).sum(), w)
    out = remat.remat(region, policy=policy, engine="functional")(x)
    new = torch.ones(4, dtype=D)
    table["unread"], table["read"] = new, new
    with RecomputeCounter() as counter:
        (got,) = torch.autograd.grad(out.pow(2).sum(), w)
    torch.testing.assert_close(got, want)
    assert counter.counts["tanh"] == 1, counter.counts


def test_a_tiny_gpt2_with_its_tied_head_given_two_values() -> None:
    """GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``: the same refusal on
    a real model, and the eager engine (the fix) gives no remat's gradients."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32)
    ids = torch.arange(16).reshape(2, 8) % 64

    def grads(engine: str | None) -> dict[str, torch.Tensor | None]:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        if engine is not None:  # one region around the model: both tied names inside
            model = remat.wrap(model, policy="nothing-saveable", engine=engine)
        params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
        params["lm_head.weight"] = (2 * params["transformer.wte.weight"]).detach().requires_grad_()
        out = functional_call(model, params, (ids,), {"use_cache": False}, tie_weights=False)
        out.logits.pow(2).mean().backward()
        return {k: v.grad for k, v in params.items()}

    with pytest.raises(SavedInputMutatedError, match="holding one tensor"):
        grads("functional")
    want = grads(None)
    with RecomputeCounter() as counter:
        got = grads("eager")
    _assert_same(got, want)
    assert counter.counts["addmm"] > 0, counter.counts
