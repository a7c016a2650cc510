"""A region returning ``(h @ W2, h)``: a hook or ``retain_grad()`` on ``h``, torch.func engine.

The region's outputs are outputs of one autograd node there, so the gradient
reaching ``h`` missed the path through the other output (1.0 where no remat
gives -1.05); parameter gradients were right. Now such a read raises
`RematError` (NOTE [ What the backward gives back ] rule 2), and the fixes it
names give no remat's gradient; programs that read only parameter gradients
(hidden states returned beside the logits) run as before.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import RecomputeCounter, assert_recomputed

import remat

POLICIES = ("nothing-saveable", "dots-saveable", "save-last")
DEPENDENT = (r"remat: .*\(.*test_dependent_outputs\.py:\d+\) returns output #1 \(shape \(4, "
             r"16\)\) and output #0, which is computed from it, and a hook or retain_grad\(\) "
             r"reads the gradient of output #1.*Use engine='eager' for this region, or split")

torch.manual_seed(0)
W1 = torch.randn(8, 16, dtype=torch.double, requires_grad=True)
W2 = torch.randn(16, 8, dtype=torch.double, requires_grad=True)
X = torch.randn(4, 8, dtype=torch.double)


def both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.tanh(x @ W1)
    return h @ W2, h


def first(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ W1)


def second(h: torch.Tensor) -> torch.Tensor:
    return h @ W2


Region = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _observe(region: Region, how: str) -> tuple[torch.Tensor, ...]:
    """The gradient ``h`` sees (by ``how``), and W1's and W2's, of a loss of both outputs."""
    W1.grad = W2.grad = None
    o, h = region(X)
    seen: list[torch.Tensor] = []
    if how == "hook":
        h.register_hook(seen.append)
    else:
        h.retain_grad()
    (o.pow(2).sum() + h.sum()).backward()
    got = seen[0] if how == "hook" else h.grad
    assert got is not None and W1.grad is not None and W2.grad is not None
    return got, W1.grad.clone(), W2.grad.clone()


def _split(policy: str, engine: str) -> Region:
    a = remat.remat(first, policy=policy, engine=engine)
    b = remat.remat(second, policy=policy, engine=engine)

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = a(x)
        return b(h), h

    return run


def _counted(run: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[tuple[torch.Tensor, ...],
                                                                    RecomputeCounter]:
    counter = RecomputeCounter()
    with counter:
        out = run()
    return out, counter


@pytest.mark.parametrize("how", ["hook", "retain_grad"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_read_gradient_of_an_output_another_depends_on_raises_and_the_fixes_work(
    policy: str, how: str
) -> None:
    want = _observe(both, how)
    with pytest.raises(remat.RematError, match=DEPENDENT):
        _observe(remat.remat(both, policy=policy, engine="functional"), how)

    # Fix 1: the eager engine.
    got, counter = _counted(lambda: _observe(remat.remat(both, policy=policy, engine="eager"), how))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert_recomputed(policy, counter.counts, lambda: _counted(
        lambda: _observe(remat.remat(both, engine="eager"), how))[1].counts)

    # Fix 2: two regions, under the torch.func engine.
    got, counter = _counted(lambda: _observe(_split(policy, "functional"), how))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    if policy == "save-last":  # the first region is demoted by the second
        assert counter.counts["tanh"] == 1 and counter.counts["mm"] == 1, counter.counts
    else:
        assert_recomputed(policy, counter.counts, lambda: _counted(
            lambda: _observe(_split("nothing-saveable", "functional"), how))[1].counts)


@pytest.mark.parametrize("engine", ["eager", "functional"])
@pytest.mark.parametrize("policy", POLICIES)
def test_parameter_gradients_alone_raise_nothing(engine: str, policy: str) -> None:
    def run(region: Region) -> tuple[torch.Tensor, ...]:
        W1.grad = W2.grad = None
        o, h = region(X)
        (o.pow(2).sum() + h.sum()).backward()
        assert W1.grad is not None and W2.grad is not None
        return W1.grad.clone(), W2.grad.clone()

    want = run(both)
    got, counter = _counted(lambda: run(remat.remat(both, policy=policy, engine=engine)))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert_recomputed(policy, counter.counts, lambda: _counted(
        lambda: run(remat.remat(both, engine=engine)))[1].counts)


@pytest.mark.parametrize("engine", ["eager", "functional"])
def test_a_hook_on_a_sibling_output_sees_no_remat_gradient(engine: str) -> None:
    """``o`` and ``h`` both made from ``a``, neither from the other: nothing missed."""

    def siblings(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x @ W1
        return torch.tanh(a) @ W2, torch.sigmoid(a)

    want = _observe(siblings, "hook")
    got, counter = _counted(lambda: _observe(remat.remat(siblings, engine=engine), "hook"))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert counter.counts["tanh"] == 1 and counter.counts["sigmoid"] == 1, counter.counts


ATTENTIONS = (r"GPT2Block\.forward .* returns the tensor #0 it lets out .* \(shape \(2, 2, 8, "
              r"8\)\) and output #0, which is computed from it")


def _gpt2(engine: str | None) -> tuple[object, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0,
                                     embd_pdrop=0.0, use_cache=False,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if engine is not None:
        remat.apply(model, policy="nothing-saveable", engine=engine)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, ids


def test_gpt2_hidden_states_retain_grad_is_no_remat_s_and_attentions_raise() -> None:
    """HF returns each block's hidden state: made by one region, read by the next, so
    a hook on it sees everything. A block's attention weights are an output its hidden
    state is computed from: retaining their gradient raises."""
    grads = []
    for engine in (None, "functional"):
        model, ids = _gpt2(engine)
        out = model(ids, labels=ids, output_hidden_states=True)  # type: ignore[operator]
        for h in out.hidden_states[1:-1]:
            h.retain_grad()
        out.loss.backward()
        grads.append([h.grad for h in out.hidden_states[1:-1]])
    for g, w in zip(grads[1], grads[0], strict=True):
        assert g is not None and w is not None
        torch.testing.assert_close(g, w)

    # Attention weights, which transformers collects by a hook: a tensor the block
    # lets out. Retaining their gradient raises; the eager engine is the fix.
    got = []
    for engine in (None, "functional", "eager"):
        model, ids = _gpt2(engine)
        out = model(ids, labels=ids, output_attentions=True)  # type: ignore[operator]
        out.attentions[0].retain_grad()
        if engine == "functional":
            with pytest.raises(remat.RematError, match=ATTENTIONS):
                out.loss.backward()
            continue
        out.loss.backward()
        got.append(out.attentions[0].grad)
    assert got[0] is not None and got[1] is not None
    torch.testing.assert_close(got[1], got[0])
