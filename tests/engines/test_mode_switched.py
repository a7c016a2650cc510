"""A module's mode switched between the forward and the backward (``model.eval()``).

The second adversarial pass: the recompute ran with the new mode (dropout off),
differentiating a forward that never ran: silent under the torch.func engine
(nothing-saveable, ``save:NAME``), a misleading "nondeterministic" error in the
eager engine. Now each module on the walk recomputes in the mode its forward ran
in (NOTE [ Bindings the recompute reads ] rule 6), and keeps the mode it has now.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import RecomputeCounter
from torch import nn

import remat

D = torch.double
POLICIES = ["nothing-saveable", "dots-saveable", "save-last", "budget:0.3"]


class Block(nn.Module):
    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8, dtype=D)
        self.drop = nn.Dropout(0.5)
        # Batch statistics in training mode, running ones in eval mode.
        self.norm = nn.BatchNorm1d(8, dtype=D) if norm else nn.LayerNorm(8, dtype=D)
        self.out = nn.Linear(8, 8, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.drop(self.lin(x)))
        # The functional form reads the flag of the region's own module.
        return self.out(self.norm(nn.functional.dropout(h, 0.25, training=self.training)))


X = torch.linspace(-2, 2, 48, dtype=D).reshape(6, 8)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _eval_before_backward(
    wrap: Callable[[nn.Module], nn.Module], norm: bool = True
) -> tuple[list[torch.Tensor], nn.Module]:
    model = Block(norm).train()
    region = wrap(model)
    torch.manual_seed(1)
    out = region(X)
    model.eval()  # an evaluation callback before the backward
    out.pow(2).sum().backward()
    return _grads(model), model


def _assert_recomputed(counter: RecomputeCounter, policy: str) -> None:
    if policy == "save-last":  # the only region is the latest one: its compute kept
        assert counter.counts["tanh"] == 0, counter.counts
    elif policy.startswith("budget"):
        assert sum(counter.counts.values()) > 0, counter.counts
    else:
        assert counter.counts["tanh"] == 1, counter.counts


@pytest.mark.parametrize("engine", ["eager", "functional"])
@pytest.mark.parametrize("policy", POLICIES)
def test_eval_between_forward_and_backward(engine: str, policy: str) -> None:
    want, plain = _eval_before_backward(lambda m: m)
    with RecomputeCounter() as counter:
        got, model = _eval_before_backward(lambda m: remat.wrap(m, policy=policy, engine=engine))
    assert len(got) == len(want) == 6
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    _assert_recomputed(counter, policy)
    assert not any(m.training for m in model.modules())  # the mode it was switched to
    # The recompute in training mode did not count the batch again.
    torch.testing.assert_close(model.norm.running_mean, plain.norm.running_mean)
    assert int(model.norm.num_batches_tracked) == int(plain.norm.num_batches_tracked) == 1


@pytest.mark.parametrize("engine", ["eager", "functional"])
@pytest.mark.parametrize("policy", POLICIES)
def test_batch_norm_in_training_mode(engine: str, policy: str) -> None:
    """The torch.func engine's recorded forward (op-tracing policies) runs under
    ``torch.func.vjp``, where torch refused batch norm's in-place write of its
    running statistics as a "captured" tensor; the buffers are now wrapped at that
    level (``differentiated.py``), written through once, as without remat."""

    def step(wrap: Callable[[nn.Module], nn.Module]) -> tuple[list[torch.Tensor], nn.Module]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8, dtype=D), nn.BatchNorm1d(8, dtype=D),
                              nn.Linear(8, 8, dtype=D)).train()
        wrap(model)(X).pow(2).sum().backward()
        return _grads(model), model

    want, plain = step(lambda m: m)
    with RecomputeCounter() as counter:
        got, model = step(lambda m: remat.wrap(m, policy=policy, engine=engine))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    for buffer, expected in zip(model.buffers(), plain.buffers(), strict=True):
        torch.testing.assert_close(buffer, expected)
    if policy == "nothing-saveable":
        assert counter.counts["native_batch_norm"] == 1, counter.counts


def _eval_then_train_forward(wrap: Callable[[nn.Module], nn.Module]) -> list[torch.Tensor]:
    """A loss term computed in eval mode with grad (a consistency loss), then one in
    training mode, then one backward of both. (No batch norm: the second forward
    would update the running statistics the first one's backward reads.)"""
    model = Block(norm=False)
    region = wrap(model)
    model.eval()
    calm = region(X)
    model.train()
    torch.manual_seed(2)
    noisy = region(X)
    ((calm - noisy).pow(2).sum() + noisy.sum()).backward()
    return _grads(model)


@pytest.mark.parametrize("engine", ["eager", "functional"])
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_a_forward_in_each_mode_then_one_backward(engine: str, policy: str) -> None:
    want = _eval_then_train_forward(lambda m: m)
    with RecomputeCounter() as counter:
        got = _eval_then_train_forward(lambda m: remat.wrap(m, policy=policy, engine=engine))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    # save-last: in the eager engine neither call reads the other's output, so both
    # stay latest; the torch.func engine's demotes the first, recomputed in eval mode.
    latest = {"eager": 0, "functional": 1}[engine]
    assert counter.counts["tanh"] == (latest if policy == "save-last" else 2), counter.counts


@pytest.mark.parametrize("engine", ["eager", "functional"])
def test_tiny_gpt2_switched_to_eval_before_backward(engine: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32, resid_pdrop=0.3, attn_pdrop=0.3,
                                     embd_pdrop=0.3)
    ids = torch.arange(24).reshape(2, 12) % 64

    def grads(use_remat: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).train()
        if use_remat:
            remat.apply(model, policy="nothing-saveable", engine=engine)
        torch.manual_seed(3)
        loss = model(ids, labels=ids, use_cache=False).loss
        model.eval()
        loss.backward()
        return _grads(model)

    want = grads(False)
    with RecomputeCounter() as counter:
        got = grads(True)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert counter.counts["addmm"] > 0, counter.counts
