"""A binding the region itself rebinds in its forward (adv8 bug4; NOTE [ Bindings the
recompute reads ] rule 8 in ``_engines/eager/bindings.py``, NOTE [ Closed-over
tensors ] rule 6 in ``_capture/closure.py``).

A rotary cache grown when a longer sequence arrives (transformers 4.3x
``_set_cos_sin_cache``, Qwen-1/Baichuan remote code) rebinds ``self.cos_cached``
(or registers the buffer again) and a Python int ``maxlen`` with it, then reads the
new tensor; the recompute reads the same new tensor and does not grow it again.
Before, every policy raised in both engines, and the named fix (a buffer) did not
work. A forward that reads the old tensor before rebinding it (a running average)
must still be right or raise; a rebinding after the forward still raises (eager).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import RecomputeCounter
from torch import nn

import remat
from remat._errors import SavedInputMutatedError

POLICIES = ["nothing-saveable", "dots-saveable", "save-last", "budget:0.3"]
ENGINES = ["eager", "functional"]


class Rotary(nn.Module):
    def __init__(self, as_buffer: bool, dim: int = 8, maxlen: int = 4) -> None:
        super().__init__()
        self.as_buffer = as_buffer
        self.inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self._set(maxlen)

    def _set(self, n: int) -> None:
        self.maxlen = n
        freqs = torch.outer(torch.arange(n).float(), self.inv)
        table = torch.cat([freqs, freqs], -1).cos()
        if self.as_buffer:
            self.register_buffer("cos_cached", table, persistent=False)
        else:
            self.cos_cached = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if n > self.maxlen:  # a longer sequence: grow the cache (reads no old table)
            self._set(n)
        return self.cos_cached[:n]


class Layer(nn.Module):
    def __init__(self, as_buffer: bool) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.o = nn.Linear(8, 8)
        self.rot = Rotary(as_buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.o(torch.tanh(self.q(x) * self.rot(x)))


def _grads(wrap: Callable[[nn.Module], Any], as_buffer: bool, between: Callable[[Layer], None]
           = lambda m: None) -> tuple[list[torch.Tensor], Layer, RecomputeCounter]:
    torch.manual_seed(0)
    layer = Layer(as_buffer)
    run = wrap(layer)
    x = torch.randn(2, 6, 8)  # longer than the cache
    with RecomputeCounter() as counter:
        loss = run(x).pow(2).sum()
        between(layer)
        loss.backward()
    return [p.grad for p in layer.parameters()], layer, counter


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("as_buffer", [False, True], ids=["attribute", "buffer"])
def test_a_cache_the_forward_grows_is_read_as_the_forward_left_it(
    as_buffer: bool, engine: str, policy: str
) -> None:
    want, plain, _ = _grads(lambda m: m, as_buffer)
    got, layer, counter = _grads(
        lambda m: remat.wrap(m, policy=policy, engine=engine), as_buffer
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert layer.rot.maxlen == 6 and tuple(layer.rot.cos_cached.shape) == (6, 8)
    torch.testing.assert_close(layer.rot.cos_cached, plain.rot.cos_cached)
    if policy == "save-last":  # the only region, the latest: nothing recomputed
        assert sum(counter.counts.values()) == 0, counter.counts
    elif policy == "nothing-saveable":
        assert counter.counts["tanh"] == 1 and counter.counts["mul"] == 1, counter.counts
        assert counter.counts["cos"] == 0, counter.counts  # the cache is not grown again
    else:
        assert sum(counter.counts.values()) >= 1, counter.counts


def test_the_eager_forward_notes_reads_only_where_a_binding_may_be_rebound() -> None:
    from remat._engines.eager.bindings import BoundAtForward, forward_reads
    from remat._replay.generators import walk_of

    plain = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    assert forward_reads(BoundAtForward.capture(plain, walk_of(plain))) is None
    grown = Layer(as_buffer=False)
    assert forward_reads(BoundAtForward.capture(grown, walk_of(grown))) is not None


class Average(nn.Module):
    """Reads its running state, then rebinds it: the recompute would read the new one."""

    def __init__(self, as_buffer: bool) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        if as_buffer:
            self.register_buffer("state", torch.zeros(8))
        else:
            self.state = torch.zeros(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state = self.state * 0.9 + x.detach().mean(0)  # read, then rebound
        return torch.tanh(self.q(x) * self.state).sum(-1)


def _average(wrap: Callable[[nn.Module], Any], as_buffer: bool) -> tuple[list[Any], Average]:
    torch.manual_seed(0)
    m = Average(as_buffer)
    run = wrap(m)
    x = torch.randn(5, 8)
    run(x).pow(2).sum().backward()
    return [p.grad for p in m.parameters()], m


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "budget:0.3"])
def test_a_running_average_read_then_rebound_raises_in_the_eager_engine(policy: str) -> None:
    with pytest.raises(SavedInputMutatedError) as caught:
        _average(lambda m: remat.wrap(m, policy=policy, engine="eager"), as_buffer=False)
    message = str(caught.value)
    assert "Average.forward" in message and ".state" in message, message
    assert "is another tensor than the forward read there" in message, message
    assert "keep it in a module buffer" in message, message
    # The fix it names: a buffer. The guard gives the recompute the start tensor.
    want, plain = _average(lambda m: m, as_buffer=True)
    with RecomputeCounter() as counter:
        got, fixed = _average(lambda m: remat.wrap(m, policy=policy, engine="eager"), True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(fixed.state, plain.state)  # updated once
    assert counter.counts["tanh"] == 1 or policy.startswith("budget"), counter.counts
    assert sum(counter.counts.values()) >= 1, counter.counts


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "budget:0.3"])
@pytest.mark.parametrize("as_buffer", [False, True], ids=["attribute", "buffer"])
def test_a_running_average_read_then_rebound_is_right_in_the_torch_func_engine(
    as_buffer: bool, policy: str
) -> None:
    # It reads what the forward read (the start state), so it recomputes the same state.
    want, plain = _average(lambda m: m, as_buffer)
    with RecomputeCounter() as counter:
        got, m = _average(lambda m: remat.wrap(m, policy=policy, engine="functional"),
                          as_buffer)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(m.state, plain.state)
    assert sum(counter.counts.values()) >= 1, counter.counts


def _rebind_after(layer: Layer) -> None:
    """After the forward, before backward: another table of the same shape."""
    if layer.rot.as_buffer:
        layer.rot.register_buffer("cos_cached", torch.zeros(6, 8), persistent=False)
    else:
        layer.rot.cos_cached = torch.zeros(6, 8)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "budget:0.3"])
def test_a_cache_rebound_after_the_forward_still_raises_in_the_eager_engine(
    policy: str,
) -> None:
    with pytest.raises(SavedInputMutatedError) as caught:
        _grads(lambda m: remat.wrap(m, policy=policy, engine="eager"), False, _rebind_after)
    assert ".rot.cos_cached" in str(caught.value), caught.value
    assert "is another tensor than the forward read there" in str(caught.value)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "budget:0.3"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_buffer_rebound_after_the_forward_is_given_back_as_the_forward_left_it(
    engine: str, policy: str
) -> None:
    # The module state guard (eager) and the slot snapshot (torch.func) give the
    # recompute the grown table the forward read, not the one bound since.
    want, _, _ = _grads(lambda m: m, True)
    got, _, _ = _grads(lambda m: remat.wrap(m, policy=policy, engine=engine), True,
                       _rebind_after)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_an_attribute_rebound_after_the_forward_is_read_as_the_forward_left_it_under_torch_func(
    policy: str,
) -> None:
    want, _, _ = _grads(lambda m: m, False)
    got, _, _ = _grads(lambda m: remat.wrap(m, policy=policy, engine="functional"), False,
                       _rebind_after)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_grown_cache_written_in_place_after_the_forward_raises_under_torch_func() -> None:
    def write(layer: Layer) -> None:
        with torch.no_grad():
            layer.rot.cos_cached.add_(1.0)

    with pytest.raises(SavedInputMutatedError) as caught:
        _grads(lambda m: remat.wrap(m, policy="nothing-saveable", engine="functional"),
               False, write)
    assert "cos_cached" in str(caught.value) and "modified in place" in str(caught.value)


def _dynamic_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=8, use_cache=False,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def _train(model: nn.Module, steps: int = 2) -> list[torch.Tensor]:
    """Two SGD steps on sequences longer than ``max_position_embeddings`` (12, then 14):
    the dynamic rope registers ``inv_freq`` again and rebinds ``max_seq_len_cached``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    for step in range(steps):
        ids = torch.randint(0, 64, (2, 12 + 2 * step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_a_tiny_llama_with_dynamic_rope_trains_as_without_remat(engine: str, policy: str) -> None:
    want = _train(_dynamic_llama())
    model = _dynamic_llama()
    remat.apply(model, policy=policy, engine=engine)
    with RecomputeCounter() as counter:
        got = _train(model)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert counter.counts["mm"] + counter.counts["addmm"] + counter.counts["bmm"] >= 1 or (
        policy == "dots-saveable"
    ), counter.counts
    assert sum(counter.counts.values()) >= 1, counter.counts
    assert tuple(model.model.rotary_emb.inv_freq.shape) == (8,)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_llama_in_one_region_whose_rope_reads_its_old_length_raises(engine: str) -> None:
    # ``max_seq_len_cached`` is read (``seq_len > max_seq_len_cached``) and then rebound:
    # rule 4, not rule 8. One region per layer (the rope outside them) is the fix above.
    model = remat.wrap(_dynamic_llama(), policy="nothing-saveable", engine=engine)
    with pytest.raises(remat.RematError, match=r"max_seq_len_cached|differs from its forward"):
        _train(model)


class Derived(nn.Module):
    """Binds a tensor computed from a parameter on its first call, reading no old one."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.q = nn.Linear(8, 8)
        self.cache = torch.zeros(8)
        self.built = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.built:
            self.cache = self.w * 2  # requires grad: its gradient must reach ``w``
            self.built = True
        return torch.tanh(self.q(x) * self.cache).sum()


def _derived(wrap: Callable[[nn.Module], Any]) -> torch.Tensor | None:
    torch.manual_seed(0)
    m = Derived()
    run = wrap(m)
    run(torch.randn(3, 8)).backward()
    return m.w.grad


def test_a_rebound_tensor_requiring_grad_is_right_or_raises() -> None:
    want = _derived(lambda m: m)
    # Eager: the recompute reads the forward's tensor, whose graph reaches ``w``.
    got = _derived(lambda m: remat.wrap(m, policy="nothing-saveable", engine="eager"))
    assert got is not None and want is not None
    torch.testing.assert_close(got, want)
    # torch.func: a tensor requiring grad let out through an attribute raises.
    for policy in ("nothing-saveable", "dots-saveable"):
        with pytest.raises(remat.RematError, match="let a tensor out"):
            _derived(lambda m, p=policy: remat.wrap(m, policy=p, engine="functional"))
    with pytest.raises(remat.RematError, match="differs from its forward"):
        _derived(lambda m: remat.wrap(m, policy="dots-saveable", engine="eager"))
