"""A tensor the region reads through a binding (a global, a closure, a dict or list
entry, an attribute), rebound or written in place between the forward and the
recompute, where no saved tensor shows it (an added bias, a running statistic).

The guarantee (DESIGN §1) is the forward's gradient or a `RematError`. Before NOTE
[ Bindings the recompute reads ] the eager engine's recompute read the new tensor
and returned the gradient of a forward that never ran (W2.grad 1.5452 -> 3.0751 on
the issue's reproducer); the torch.func engine passes such tensors as inputs of
its Function and reads what the forward read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import RecomputeCounter

import remat
from remat._engines.eager.bindings import BoundAtForward
from remat._errors import SavedInputMutatedError
from remat._replay.generators import walk_of

D = torch.double
POLICIES = ["nothing-saveable", "dots-saveable", "budget:0.3"]

BIAS = torch.zeros(4, dtype=D)


class _Box:
    bias: torch.Tensor


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    w1 = torch.randn(3, 4, dtype=D, requires_grad=True)
    w2 = torch.randn(4, 2, dtype=D, requires_grad=True)
    return w1, w2


def _program(kind: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], None]]:
    """A region reading a bias from ``kind`` of binding, and what rebinds it."""
    global BIAS
    w1, w2 = WEIGHTS
    BIAS = torch.zeros(4, dtype=D)
    table = {"bias": torch.zeros(4, dtype=D)}
    items = [torch.zeros(4, dtype=D)]
    box = _Box()
    box.bias = torch.zeros(4, dtype=D)
    cell = [torch.zeros(4, dtype=D)]
    bias = cell[0]

    def read() -> torch.Tensor:
        return {"global": lambda: BIAS, "dict": lambda: table["bias"],
                "list": lambda: items[0], "attribute": lambda: box.bias,
                "closure": lambda: bias}[kind]()

    def region(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w1 + read()) @ w2  # ``+`` saves nothing of the bias

    def rebind() -> None:
        global BIAS
        nonlocal bias
        new = torch.ones(4, dtype=D)
        BIAS, table["bias"], items[0], box.bias, bias = new, new, new, new, new

    return region, rebind


WEIGHTS = _weights()


def _assert_recomputed_tanh(counter: RecomputeCounter, policy: str, calls: int) -> None:
    """Each call's tanh ran again in backward (a budget may keep it: then something else)."""
    if policy.startswith("budget"):
        assert sum(counter.counts.values()) >= calls, counter.counts
    else:
        assert counter.counts["tanh"] == calls, counter.counts


def _grads(out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.sum(), WEIGHTS)


def _rebound_after_forward(kind: str, wrap: Callable[[Any], Any], x: torch.Tensor) -> torch.Tensor:
    """The output of ``wrap(region)`` on ``x``, with the bias rebound after the forward."""
    fn, rebind = _program(kind)
    out: torch.Tensor = wrap(fn)(x)
    rebind()
    return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["global", "dict", "list", "attribute", "closure"])
def test_rebound_after_the_forward_raises_in_the_eager_engine(kind: str, policy: str) -> None:
    x = torch.randn(5, 3, dtype=D)
    want = _grads(_rebound_after_forward(kind, lambda f: f, x))
    out = _rebound_after_forward(kind, lambda f: remat.remat(f, policy=policy, engine="eager"), x)
    with pytest.raises(SavedInputMutatedError) as caught:
        _grads(out)
    message = str(caught.value)
    assert "the recompute of _program.<locals>.region (" in message, message
    assert "is another tensor than the forward read there" in message, message
    assert "Pass the tensor to the region as an argument" in message

    # The fix it names: the bias as an argument (the frame holds what the forward read).
    w1, w2 = WEIGHTS
    fixed = remat.remat(lambda x, b: torch.tanh(x @ w1 + b) @ w2, policy=policy,
                        engine="eager")
    _, rebind = _program(kind)
    with RecomputeCounter() as counter:
        out = fixed(x, torch.zeros(4, dtype=D))
        rebind()
        got = _grads(out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    _assert_recomputed_tanh(counter, policy, 1)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["global", "dict", "list", "attribute", "closure"])
def test_the_torch_func_engine_reads_what_the_forward_read(kind: str, policy: str) -> None:
    x = torch.randn(5, 3, dtype=D)
    want = _grads(_rebound_after_forward(kind, lambda f: f, x))
    out = _rebound_after_forward(
        kind, lambda f: remat.remat(f, policy=policy, engine="functional"), x
    )
    for g, w in zip(_grads(out), want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("policy", POLICIES)
def test_written_in_place_after_the_forward_raises(policy: str) -> None:
    w1, w2 = WEIGHTS
    bias = torch.zeros(4, dtype=D)
    region = remat.remat(lambda x: torch.tanh(x @ w1 + bias) @ w2, policy=policy,
                         engine="eager")
    x = torch.randn(5, 3, dtype=D)
    out = region(x)
    with torch.no_grad():
        bias.add_(1.0)
    with pytest.raises(SavedInputMutatedError, match=r"closure variable 'bias'.*written in "
                       r"place since the forward read it \(version 0, now 1\)"):
        _grads(out)
    # The fix: modify it after backward.
    bias.zero_()
    plain = _grads(torch.tanh(x @ w1 + bias) @ w2)
    out = region(x)
    got = _grads(out)
    with torch.no_grad():
        bias.add_(1.0)
    for g, w in zip(got, plain, strict=True):
        torch.testing.assert_close(g, w)


def test_a_tensor_with_a_grad_fn_made_outside_the_region_and_rebound_raises() -> None:
    """The adversarial report's first case: ``ctx['w'] = W1 * 1.0`` read by a matmul."""
    w1, w2 = WEIGHTS
    ctx = {"w": w1.t() * 1.0}
    region = remat.remat(lambda x: torch.tanh(x @ ctx["w"].t()) @ w2, engine="eager")
    out = region(torch.randn(5, 3, dtype=D))
    ctx["w"] = w1.t() * 2.0  # e.g. the next micro-batch's view
    with pytest.raises(SavedInputMutatedError, match=r"'ctx'\]?.*\['w'\]"):
        _grads(out)


def test_a_binding_the_recompute_does_not_read_may_change() -> None:
    """An attribute the region stores its output in (an escape kept detached) is
    rebound by the next call: nothing raises, the gradient is no remat's."""
    w1, w2 = WEIGHTS
    box = _Box()
    box.bias = torch.zeros(4, dtype=D)

    def region(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w1)
        box.bias = h.detach().mean(0)  # written, never read
        return h @ w2

    x = torch.randn(5, 3, dtype=D)
    want = _grads(region(x) + region(2 * x))
    wrapped = remat.remat(region, engine="eager")
    with RecomputeCounter() as counter:
        got = _grads(wrapped(x) + wrapped(2 * x))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    _assert_recomputed_tanh(counter, "nothing-saveable", 2)


class RunningMean(torch.nn.Module):
    """A forward-only statistic, as the docs' ``remat.is_recomputing()`` recipe has it."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.lin = torch.nn.Linear(3, 4, dtype=D)
        self.stats: dict[str, torch.Tensor] = {"mean": torch.zeros(4, dtype=D)}
        self.register_buffer("mean", torch.zeros(4, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = self.stats["mean"] if self.where == "dict" else self.mean
        h = torch.tanh(self.lin(x) - mean)
        if not remat.is_recomputing():
            new = 0.9 * mean + 0.1 * h.detach().mean(0)
            if self.where == "dict":
                self.stats["mean"] = new
            else:
                self.mean.copy_(new)
        return h


def _two_calls(model: Any, x: torch.Tensor) -> list[torch.Tensor]:
    out = model(x).sum() + model(2 * x).sum()
    return list(torch.autograd.grad(out, list(model.parameters())))


def test_a_running_statistic_in_a_dict_raises_and_a_buffer_is_the_fix() -> None:
    x = torch.randn(5, 3, dtype=D)
    torch.manual_seed(1)
    model = RunningMean("dict")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SavedInputMutatedError, match=r"keep it in a module buffer"):
        _two_calls(remat.wrap(model, engine="eager"), x)

    # The fix the message names: the statistic in a module buffer.
    buffered = RunningMean("buffer")
    buffered.load_state_dict(state)
    want = _two_calls(buffered, x)
    buffered.load_state_dict(state)
    with RecomputeCounter() as counter:
        got = _two_calls(remat.wrap(buffered, engine="eager"), x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    _assert_recomputed_tanh(counter, "nothing-saveable", 2)


def test_a_function_reaching_no_tensor_and_no_module_notes_nothing() -> None:
    """NOTE rule 2: nothing on the walk to read again, so the forward pays nothing."""
    assert BoundAtForward.capture(torch.sin, walk_of(torch.sin)) is None
    bound = BoundAtForward.capture(_Box, walk_of(_Box))
    assert bound is None or (bound.tensors == [] and bound.modules == [])


class _Replaceable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 4, dtype=D)
        self.scale = torch.nn.Parameter(torch.ones(4, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


@pytest.mark.parametrize("policy", ["nothing-saveable", "budget:0.3"])
def test_a_submodule_replaced_before_backward_raises(policy: str) -> None:
    """NOTE rule 5. Before, ``nothing-saveable`` ran the new ``Linear`` in the
    recompute: ``scale``'s gradient came out -2.04 where 2.58 is right."""
    torch.manual_seed(0)
    model = _Replaceable()
    x = torch.randn(5, 3, dtype=D)
    out = remat.wrap(model, policy=policy, engine="eager")(x)
    old = model.lin
    model.lin = torch.nn.Linear(3, 4, dtype=D)  # model surgery before backward
    replaced = (r"submodule (module\.)?lin of _Replaceable\.forward \(.*\) was replaced "
                r"after its forward pass ran the Linear there")
    with pytest.raises(SavedInputMutatedError, match=replaced):
        out.pow(2).sum().backward()

    # The fix: replace it after backward.
    model.lin = old
    model.zero_grad()
    out = model(x)
    want = torch.autograd.grad(out.pow(2).sum(), [model.scale, old.weight])
    out = remat.wrap(model, policy=policy, engine="eager")(x)
    got = torch.autograd.grad(out.pow(2).sum(), [model.scale, old.weight])
    model.lin = torch.nn.Linear(3, 4, dtype=D)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_tiny_gpt2_block_replaced_before_backward_raises_and_trains_otherwise() -> None:
    """On a real model: no false positive in a training step, and the surgery raises."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32,
                                     n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0,
                                     embd_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config)
    model = transformers.GPT2LMHeadModel(config)
    model.load_state_dict(plain.state_dict())
    remat.apply(model, policy="nothing-saveable", engine="eager",
                where=lambda name, module: isinstance(module, type(model.transformer.h[0])))
    ids = torch.randint(0, 32, (2, 8))
    plain(ids, labels=ids).loss.backward()
    model(ids, labels=ids).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)

    loss = model(ids, labels=ids).loss
    model.transformer.h[1].mlp = transformers.models.gpt2.modeling_gpt2.GPT2MLP(64, config)
    with pytest.raises(SavedInputMutatedError, match=r"submodule .*mlp.* was replaced"):
        loss.backward()
