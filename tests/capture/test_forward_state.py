"""State the forward changes changes once per real forward, or remat raises.

Module buffers the forward writes (without registering the module), parameters
updated under ``no_grad``, ``.grad`` accumulated by a ``.backward()`` inside the
region, a closed-over ``nonlocal`` counter, and an explicit ``torch.Generator``:
after one step, each must be as it is after one step without remat, with the
same gradients, in both engines and under several policies; where remat cannot
restore the state, it raises `remat.RematError` naming the region, and the fix
it names works (NOTE [ State the forward changes ] in ``_capture/module_state.py``,
NOTE [ Explicit generators ] in ``_replay/rng.py``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import Engine
from helpers import CORE_POLICIES, OpCounter, assert_close_all
from torch import nn
from torch.func import functional_call

import remat


def _x() -> torch.Tensor:
    return torch.randn(4, 3, dtype=torch.double, generator=torch.Generator().manual_seed(2))


def _tail(h: torch.Tensor) -> torch.Tensor:
    return h.sin().sum()


def _step(
    engine: Engine, fn: Callable[..., torch.Tensor], policy: str | None, *xs: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], int]:
    """Gradients of ``_tail(fn(*xs))`` and how many ``tanh`` ran, with ``fn`` a region
    under ``policy`` (None: no remat). The tail is a region too, so that under
    ``save-last`` the first one is recomputed."""
    if policy is None:
        loss: Callable[..., torch.Tensor] = lambda *a: _tail(fn(*a))  # noqa: E731
    else:
        region: Any = engine.remat(fn, policy=policy)
        tail: Any = engine.remat(_tail, policy=policy)
        loss = lambda *a: tail(region(*a))  # noqa: E731
    with OpCounter() as counter:
        grads = engine.grads(loss, *xs)
    return grads, counter.counts["tanh"]


def _check_recomputed(engine: Engine, fn: Callable[..., torch.Tensor], policy: str,
                      make: Callable[[], tuple[torch.Tensor, ...]]) -> None:
    """The region's ``tanh`` ran once more than without remat: it was recomputed."""
    _, plain = _step(engine, fn, None, *make())
    _, rematted = _step(engine, fn, policy, *make())
    assert rematted == plain + 1


# -- module buffers the forward writes, no registration -------------------------------


class Seen(nn.Module):
    """Counts its calls in a buffer the math reads (not registered as stateful)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.register_buffer("seen", torch.zeros((), dtype=torch.double))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # under torch.func the buffer is an input: no_grad to write it
            self.seen += 1
        return (remat.checkpoint_name(self.lin(h), "hidden") * self.seen).tanh()


class Case:
    """A module's region under one engine, and where the state it changes lives.

    Eager: the region closes over the module, whose own buffer or parameter
    changes. torch.func cannot write a tensor a transform captured (with or
    without remat), so there the region calls ``functional_call`` with the
    state passed in (as a differentiated input), which changes.
    """

    def __init__(self, engine: Engine, module: nn.Module, state: str) -> None:
        self.engine, self.module, self.state = engine, module, state
        self.inputs: tuple[torch.Tensor, ...] = ()

    def fn(self, h: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        if self.engine.name == "eager":
            return self.module(h)
        names = [n for n, _ in self.module.named_parameters()]
        names += [n for n, _ in self.module.named_buffers()]
        return functional_call(self.module, dict(zip(names, tensors, strict=True)), (h,))

    def make_inputs(self) -> tuple[torch.Tensor, ...]:
        self.inputs = (_x(),)
        if self.engine.name == "functional":
            tensors = [*self.module.parameters(), *self.module.buffers()]
            self.inputs += tuple(t.detach().clone() for t in tensors)
        return self.inputs

    def changed(self) -> torch.Tensor:
        """The state after the step."""
        if self.engine.name == "eager":
            return getattr(self.module, self.state).detach()
        names = [n for n, _ in self.module.named_parameters()]
        names += [n for n, _ in self.module.named_buffers()]
        return self.inputs[1 + names.index(self.state)]

    def step(self, policy: str | None) -> tuple[torch.Tensor, ...]:
        return _step(self.engine, self.fn, policy, *self.make_inputs())[0]


def _seen(engine: Engine) -> Case:
    torch.manual_seed(0)
    return Case(engine, Seen(), "seen")


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_a_buffer_the_forward_writes_counts_once(engine: Engine, policy: str) -> None:
    plain, case = _seen(engine), _seen(engine)
    expected = plain.step(None)
    actual = case.step(policy)
    assert_close_all(actual, expected)
    assert float(case.changed()) == float(plain.changed()) == 1.0  # written once
    if engine.name == "functional":
        assert float(case.module.seen) == 0.0  # the module's own: never written
    _check_recomputed(engine, _seen(engine).fn, policy, _seen(engine).make_inputs)


class Counts(nn.Module):
    """``self.calls += 1`` outside ``no_grad``, read by the math: plain eager code."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.register_buffer("calls", torch.zeros((), dtype=torch.double))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (remat.checkpoint_name(self.lin(h), "hidden") * self.calls).tanh()


@pytest.mark.parametrize("how", ["closure", "wrap"])
@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_a_closed_over_module_counting_in_a_buffer(how: str, policy: str) -> None:
    torch.manual_seed(0)
    plain = Counts()
    module = copy.deepcopy(plain)
    x = _x().requires_grad_()
    expected = torch.autograd.grad(_tail(plain(x)), [x, *plain.parameters()])
    if how == "wrap":
        region: Any = remat.wrap(module, policy=policy)
    else:
        region = remat.remat(lambda h: module(h), policy=policy)
    tail = remat.remat(_tail, policy=policy)
    actual = torch.autograd.grad(tail(region(x)), [x, *module.parameters()])
    assert_close_all(actual, expected)
    assert float(module.calls) == float(plain.calls) == 1.0


class Big(nn.Module):
    """Accumulates into a buffer too large for remat to copy on every forward."""

    def __init__(self) -> None:
        super().__init__()
        size = remat._capture.module_state.SNAPSHOT_BYTES // 8 + 1  # one double too many
        self.register_buffer("acc", torch.zeros(size, dtype=torch.double))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.acc[:3] += 1
        return (remat.checkpoint_name(h * self.acc[:3], "hidden")).tanh()


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_a_large_buffer_the_forward_writes_raises_and_stateful_fixes(
    engine: Engine, policy: str
) -> None:
    plain = Case(engine, Big(), "acc")
    expected = plain.step(None)
    case = Case(engine, Big(), "acc")
    with pytest.raises(remat.RematError, match="remat_stateful = True") as info:
        case.step(policy)
    message = str(info.value)
    assert "Case.fn (" in message and "test_forward_state.py" in message  # the region
    assert "buffer 'acc'" in message
    case = Case(engine, Big(), "acc")
    case.module.remat_stateful = True  # the fix the message names
    assert_close_all(case.step(policy), expected)
    assert torch.equal(case.changed(), plain.changed())


# -- parameters updated under no_grad -----------------------------------------------


class Decay(nn.Module):
    """Decays its own weight in forward, under ``no_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3, dtype=torch.double))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.w.mul_(0.5)
        return remat.checkpoint_name(h @ self.w, "hidden").tanh()


def _decay(engine: Engine) -> Case:
    torch.manual_seed(0)
    return Case(engine, Decay(), "w")


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_a_parameter_decayed_in_forward_raises_and_stateful_fixes(
    engine: Engine, policy: str
) -> None:
    plain = _decay(engine)
    expected = plain.step(None)
    with pytest.raises(remat.RematError, match="remat_stateful = True") as info:
        _decay(engine).step(policy)
    message = str(info.value)
    assert "Case.fn (" in message and "test_forward_state.py" in message  # the region
    assert "parameter 'w'" in message
    case = _decay(engine)
    case.module.remat_stateful = True  # the fix the message names
    assert_close_all(case.step(policy), expected)
    torch.testing.assert_close(case.changed(), plain.changed())  # decayed once
    fixed = _decay(engine)
    fixed.module.remat_stateful = True
    _check_recomputed(engine, fixed.fn, policy, fixed.make_inputs)


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_a_module_parameter_decayed_in_forward_eager(policy: str) -> None:
    torch.manual_seed(0)
    plain = Decay()
    x = _x().requires_grad_()
    expected = torch.autograd.grad(_tail(plain(x)), [x, plain.w])
    for stateful in (False, True):
        torch.manual_seed(0)
        module = Decay()
        module.remat_stateful = stateful
        region = remat.remat(module.__call__, policy=policy)
        tail = remat.remat(_tail, policy=policy)
        out = tail(region(x))
        if not stateful:
            with pytest.raises(remat.RematError, match="modified parameter 'w'"):
                torch.autograd.grad(out, [x, module.w])
            continue
        assert_close_all(torch.autograd.grad(out, [x, module.w]), expected)
        torch.testing.assert_close(module.w, plain.w)  # decayed once


# -- a .backward() inside the region --------------------------------------------------


def _inner_backward(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(h: torch.Tensor) -> torch.Tensor:
        (w * h.detach()).sum().backward(inputs=[w])
        return remat.checkpoint_name(h * w, "hidden").tanh()

    return fn


@pytest.mark.parametrize("start", ["empty", "accumulated"])
@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_a_backward_inside_the_region_accumulates_once(
    engine: Engine, policy: str, start: str
) -> None:
    def leaf() -> torch.Tensor:
        w = torch.linspace(0.5, 1.5, 3, dtype=torch.double).requires_grad_()
        if start == "accumulated":
            w.grad = torch.ones(3, dtype=torch.double)
        return w

    if engine.name == "functional":
        # torch.func refuses .backward() inside a transform, with or without remat:
        # remat says so whatever the policy (nothing-saveable's forward has no
        # autograd at all), naming the region and the fix.
        with pytest.raises(RuntimeError, match=r"backward\(\) called inside a functorch"):
            _step(engine, _inner_backward(leaf()), None, _x())
        with pytest.raises(remat.RematError, match=(
            r"_inner_backward\.<locals>\.fn \(.*test_forward_state\.py:\d+\) calls "
            r"\.backward\(\) inside the region, under a torch\.func transform.*"
            r"differentiate the whole computation with loss\.backward\(\)"
        )):
            _step(engine, _inner_backward(leaf()), policy, _x())
        # The fix it names: loss.backward() outside torch.func (where engine='auto',
        # the default, picks the eager engine) works, and accumulates once.
        engine = Engine("eager")
    w_plain = leaf()
    expected, _ = _step(engine, _inner_backward(w_plain), None, _x())
    w = leaf()
    actual, _ = _step(engine, _inner_backward(w), policy, _x())
    assert_close_all(actual, expected)
    assert w.grad is not None and w_plain.grad is not None
    torch.testing.assert_close(w.grad, w_plain.grad)
    _check_recomputed(engine, _inner_backward(leaf()), policy, lambda: (_x(),))


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_a_backward_inside_a_forced_functional_region_names_the_engine(policy: str) -> None:
    def w_leaf() -> torch.Tensor:
        return torch.linspace(0.5, 1.5, 3, dtype=torch.double).requires_grad_()

    def grads(region: Callable[..., torch.Tensor], w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = _x().requires_grad_()
        return (*torch.autograd.grad(_tail(region(x)), [x]), w.grad)  # type: ignore[misc]

    forced = remat.remat(_inner_backward(w_leaf()), policy=policy, engine="functional")
    with pytest.raises(remat.RematError, match=(
        r"_inner_backward\.<locals>\.fn \(.*\) calls \.backward\(\) inside the region, "
        r"and engine='functional'.*Use engine='auto' \(the default\) or engine='eager'"
    )):
        grads(forced, w_leaf())
    w_plain, w = w_leaf(), w_leaf()  # the fix: the default engine
    expected = grads(_inner_backward(w_plain), w_plain)
    assert_close_all(grads(remat.remat(_inner_backward(w), policy=policy), w), expected)


def test_a_backward_into_module_parameters_inside_a_wrapped_module() -> None:
    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3).double()

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            self.lin(h.detach()).pow(2).sum().backward(inputs=list(self.lin.parameters()))
            return self.lin(h).tanh()

    torch.manual_seed(0)
    plain = Probe()
    wrapped = remat.wrap(copy.deepcopy(plain))
    x = _x().requires_grad_()
    _tail(plain(x)).backward(inputs=[x])
    expected = x.grad
    x.grad = None
    _tail(wrapped(x)).backward(inputs=[x])
    torch.testing.assert_close(x.grad, expected)
    for a, b in zip(wrapped.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


# -- closed-over Python counters ------------------------------------------------------


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_a_nonlocal_counter_counts_once(engine: Engine, policy: str) -> None:
    def counted() -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], int]]:
        count = 0

        def fn(h: torch.Tensor) -> torch.Tensor:
            nonlocal count
            count += 1
            return remat.checkpoint_name(h.sin() * count, "hidden").tanh()

        return fn, lambda: count

    plain, plain_count = counted()
    expected, _ = _step(engine, plain, None, _x())
    fn, count = counted()
    actual, _ = _step(engine, fn, policy, _x())
    assert_close_all(actual, expected)
    assert count() == plain_count() == 1
    _check_recomputed(engine, counted()[0], policy, lambda: (_x(),))


def test_a_counter_in_a_helper_closure_counts_once() -> None:
    count = 0

    def bump() -> int:
        nonlocal count
        count += 1
        return count

    region = remat.remat(lambda h: (h.sin() * bump()).tanh())
    x = _x().requires_grad_()
    _tail(region(x)).backward()
    assert count == 1
    torch.testing.assert_close(x.grad, torch.autograd.grad(_tail((x.sin() * 1).tanh()), x)[0])


# -- explicit generators --------------------------------------------------------------


def _drawing(gen: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(h: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(h.shape, generator=gen, dtype=h.dtype)
        return remat.checkpoint_name(h.sin() * noise, "hidden").tanh()

    return fn


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_an_explicit_generator_draws_once(engine: Engine, policy: str) -> None:
    plain_gen = torch.Generator().manual_seed(7)
    expected, _ = _step(engine, _drawing(plain_gen), None, _x())
    gen = torch.Generator().manual_seed(7)
    actual, _ = _step(engine, _drawing(gen), policy, _x())
    assert_close_all(actual, expected)
    assert torch.equal(gen.get_state(), plain_gen.get_state())  # one draw, as without remat
    _check_recomputed(
        engine, _drawing(torch.Generator().manual_seed(7)), policy, lambda: (_x(),)
    )


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(3)
        self.lin = nn.Linear(3, 3).double()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (self.lin(h) * torch.rand(h.shape, generator=self.gen, dtype=h.dtype)).tanh()


@pytest.mark.parametrize("how", ["argument", "module-attribute", "partial"])
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_a_generator_reached_otherwise(how: str, policy: str) -> None:
    def draw(h: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return (h.sin() * torch.rand(h.shape, generator=gen, dtype=h.dtype)).tanh()

    x = _x().requires_grad_()
    plain_gen = torch.Generator().manual_seed(5)
    gen = torch.Generator().manual_seed(5)
    if how == "module-attribute":
        plain, module = Noisy(), Noisy()
        module.load_state_dict(plain.state_dict())
        expected = torch.autograd.grad(_tail(plain(x)), x)[0]
        actual = torch.autograd.grad(_tail(remat.wrap(module, policy=policy)(x)), x)[0]
        torch.testing.assert_close(actual, expected)
        assert torch.equal(module.gen.get_state(), plain.gen.get_state())
        return
    expected = torch.autograd.grad(_tail(draw(x, plain_gen)), x)[0]
    if how == "argument":
        out = remat.remat(draw, policy=policy)(x, gen)
    else:
        out = remat.remat(functools.partial(draw, gen=gen), policy=policy)(x)
    torch.testing.assert_close(torch.autograd.grad(_tail(out), x)[0], expected)
    assert torch.equal(gen.get_state(), plain_gen.get_state())


# -- a Hugging Face model with instrumented layers -----------------------------------


def _count_call(module: nn.Module, args: Any) -> None:
    module.calls.add_(1)


def _llama_with_counters() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaModel(cfg).double()
    for layer in model.layers:
        # Instrumentation inside each layer: a call counter in a buffer, bumped by
        # a hook of a submodule (so it runs in the layer's region and its recompute).
        layer.mlp.register_buffer("calls", torch.zeros((), dtype=torch.long))
        layer.mlp.register_forward_pre_hook(_count_call)
    return model


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_hugging_face_layers_count_their_calls_once(engine: Engine, policy: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    plain, model = _llama_with_counters(), _llama_with_counters()
    remat.apply(model, where=LlamaDecoderLayer, policy=policy)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    names = [name for name, _ in plain.named_parameters()]

    def loss(m: nn.Module) -> Callable[..., torch.Tensor]:
        def fn(*tensors: torch.Tensor) -> torch.Tensor:
            params = dict(zip(names, tensors, strict=True))
            out = functional_call(m, params, (ids,), {"use_cache": False})
            return out.last_hidden_state.pow(2).sum()

        return fn

    reference = [p.detach().requires_grad_() for p in plain.parameters()]
    if engine.name == "functional" and policy != "nothing-saveable":
        # torch.func refuses a write to a buffer a transform captured, with or without
        # remat (only the torch.func engine's unrecorded forward runs below it): the
        # program is refused as it is without remat, by torch, never run wrong.
        with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
            engine.grads(loss(_llama_with_counters()), *(p.detach() for p in reference))
        with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
            engine.grads(loss(model), *(p.detach() for p in model.parameters()))
        return
    expected = torch.autograd.grad(loss(plain)(*reference), reference)
    with OpCounter() as counter:
        actual = engine.grads(loss(model), *(p.detach() for p in model.parameters()))
    assert_close_all(actual, expected)
    assert [int(layer.mlp.calls) for layer in plain.layers] == [1, 1]
    assert [int(layer.mlp.calls) for layer in model.layers] == [1, 1]  # not 2
    # Each layer's MLP activation ran again in the recompute (save-last: all but the last).
    recomputed = 1 if policy == "save-last" else 2
    assert counter.counts["silu"] == 2 + recomputed
