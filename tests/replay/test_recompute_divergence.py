"""A recompute that differs from its forward raises under every policy, in both engines.

Three programs that change between forward and backward, each under both engines
and several policies: a cache the region appends to and reads back (the
recompute attends over twice the keys), a global flag flipped before backward
(``sin`` in the forward, ``cos`` in the recompute, same shapes), and a flag that
drops a saving op from the recompute. Each must raise
`NondeterministicRecomputeError` naming the region, and each fix the message
suggests must then give the gradients of the program without remat. Then a tiny
Hugging Face GPT-2 in training with the default ``use_cache=True``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import CORE_POLICIES, OpCounter, assert_close_each

import remat
from tests.conftest import Engine

#: The core policies and offload (an offloaded value is fetched, not recomputed).
DIVERGENCE_POLICIES = (*CORE_POLICIES, "offload-dots")

Fn = Callable[..., torch.Tensor]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64) / 3


def _reference(program: Fn, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaves = [x.detach().requires_grad_() for x in xs]
    return torch.autograd.grad(program(*leaves), leaves)


def _raises_naming(engine: Engine, program: Fn, region_fn: Fn, *xs: torch.Tensor) -> str:
    """Run ``program`` under ``engine``; it must raise naming ``region_fn`` and its line."""
    with pytest.raises(remat.NondeterministicRecomputeError) as info:
        engine.grads(program, *xs)
    message = str(info.value)
    line = region_fn.__code__.co_firstlineno
    assert re.search(rf"{region_fn.__name__} \(.*test_recompute_divergence\.py:{line}\)", message)
    assert "determinism_check=False" not in message  # it is no cure: it only hides the check
    return message


# -- a cache that grows ----------------------------------------------------------


def attend_with_cache(cache: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One attention step that appends its key to ``cache`` and attends over the cache."""
    k = remat.checkpoint_name(x @ w, "hidden")
    cache.append(k)
    keys = torch.cat(cache)
    return torch.softmax(x @ keys.T, -1) @ keys


def _cached_blocks(wrap: Callable[[Fn], Fn]) -> tuple[list[list[torch.Tensor]], list[Fn]]:
    """Two layers, each with its own cache (a list its region closes over)."""
    caches: list[list[torch.Tensor]] = [[], []]

    def layer(cache: list[torch.Tensor]) -> Fn:
        def cached_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return attend_with_cache(cache, x, w)

        return cached_block

    return caches, [wrap(layer(cache)) for cache in caches]


def _cache_program(wrap: Callable[[Fn], Fn]) -> tuple[Fn, Fn]:
    """The program, and the (unwrapped) function of its first region."""
    caches, blocks = _cached_blocks(wrap)

    def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        for cache in caches:
            cache.clear()
        for block in blocks:  # two regions: save-last recomputes the first
            x = block(x, w)
        return x.pow(2).sum()

    return program, _cached_blocks(lambda f: f)[1][0]


def passing_the_cache(past: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> Any:
    """The fix: the cache is an argument and the new entries are returned."""
    k = remat.checkpoint_name(x @ w, "hidden")
    keys = torch.cat([past, k])
    return torch.softmax(x @ keys.T, -1) @ keys, keys


def _functional_cache_program(block: Fn) -> Fn:
    def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        pasts = [x[:0] for _ in range(2)]
        for layer in range(2):
            x, pasts[layer] = block(pasts[layer], x, w)
        return x.pow(2).sum()

    return program


@pytest.mark.parametrize("policy", DIVERGENCE_POLICIES)
def test_a_cache_that_grows_raises_and_passing_it_fixes(engine: Engine, policy: str) -> None:
    x, w = _inputs()
    expected = _reference(_cache_program(lambda f: f)[0], x, w)
    program, region_fn = _cache_program(lambda f: engine.remat(f, policy=policy))  # type: ignore[arg-type,return-value]
    message = _raises_naming(engine, program, region_fn, x, w)
    assert "use_cache=False" in message and "pass the cache in as an argument" in message
    assert "everything-saveable" in message

    fixed = engine.remat(passing_the_cache, policy=policy)
    assert_close_each(engine.grads(_functional_cache_program(fixed), x, w), expected)  # type: ignore[arg-type]
    assert_close_each(_reference(_functional_cache_program(passing_the_cache), x, w), expected)


def test_a_cache_that_grows_is_right_with_everything_saveable(engine: Engine) -> None:
    x, w = _inputs()
    expected = _reference(_cache_program(lambda f: f)[0], x, w)
    program, _ = _cache_program(lambda f: engine.remat(f, policy="everything-saveable"))  # type: ignore[arg-type,return-value]
    assert_close_each(engine.grads(program, x, w), expected)


# -- a flag flipped between forward and backward ---------------------------------

_FLAG = {"sin": True}


def flagged_block(x: torch.Tensor, w: torch.Tensor, sin: bool | None = None) -> torch.Tensor:
    """``sin`` or ``cos``: the same ops' shapes either way; a global flag unless passed."""
    use_sin = _FLAG["sin"] if sin is None else sin
    h = remat.checkpoint_name(x @ w, "hidden")
    h = h.sin() if use_sin else h.cos()
    return h @ w


def _flag_program(block: Fn, pass_flag: bool = False) -> Fn:
    def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        _FLAG["sin"] = True
        for _ in range(2):
            x = block(x, w, sin=_FLAG["sin"]) if pass_flag else block(x, w)
        _FLAG["sin"] = False  # flipped after the forward, before the backward
        return x.pow(2).sum()

    return program


@pytest.mark.parametrize("policy", DIVERGENCE_POLICIES)
def test_a_flag_flipped_before_backward_raises_and_an_argument_fixes(
    engine: Engine, policy: str
) -> None:
    x, w = _inputs()
    expected = _reference(_flag_program(flagged_block), x, w)
    block = engine.remat(flagged_block, policy=policy)
    message = _raises_naming(engine, _flag_program(block), flagged_block, x, w)  # type: ignore[arg-type]
    assert "static_argnums/static_argnames" in message

    fixed = engine.remat(flagged_block, policy=policy, static_argnames=("sin",))
    counter = OpCounter()
    with counter:
        found = engine.grads(_flag_program(fixed, pass_flag=True), x, w)  # type: ignore[arg-type]
    assert_close_each(found, expected)
    # The recompute ran the forward's `sin` (two forwards, and two recomputes
    # unless the policy keeps them: save-last keeps the last region's).
    recomputed = {"nothing-saveable": 2, "save-last": 1}.get(policy, 2)
    assert counter.counts["sin"] == 2 + recomputed


def test_a_flipped_flag_is_right_with_everything_saveable(engine: Engine) -> None:
    x, w = _inputs()
    expected = _reference(_flag_program(flagged_block), x, w)
    block = engine.remat(flagged_block, policy="everything-saveable")
    assert_close_each(engine.grads(_flag_program(block), x, w), expected)  # type: ignore[arg-type]


# -- a flag that drops a saving op from the recompute -----------------------------


def shortened_block(x: torch.Tensor, w: torch.Tensor, squash: bool | None = None) -> torch.Tensor:
    h = remat.checkpoint_name(x @ w, "hidden")
    if (_FLAG["sin"] if squash is None else squash):
        h = h.tanh()  # saves its output in the forward only
    return h


@pytest.mark.parametrize("policy", ("nothing-saveable", "save:hidden"))
def test_an_op_missing_from_the_recompute_raises_and_an_argument_fixes(
    engine: Engine, policy: str
) -> None:
    x, w = _inputs()
    expected = _reference(_flag_program(shortened_block), x, w)
    block = engine.remat(shortened_block, policy=policy)
    _raises_naming(engine, _flag_program(block), shortened_block, x, w)  # type: ignore[arg-type]
    fixed = engine.remat(shortened_block, policy=policy, static_argnames=("squash",))

    def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        _FLAG["sin"] = True
        for _ in range(2):
            x = fixed(x, w, squash=_FLAG["sin"])  # type: ignore[operator]
        _FLAG["sin"] = False
        return x.pow(2).sum()

    assert_close_each(engine.grads(program, x, w), expected)


def test_the_same_program_passes_the_check(engine: Engine) -> None:
    """No false alarm: an unchanged program under every policy, a nested region included."""
    x, w = _inputs()
    _FLAG["sin"] = True
    inner = engine.remat(flagged_block, policy="dots-saveable")

    def outer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return inner(flagged_block(x, w), w)  # type: ignore[operator]

    expected = _reference(lambda x, w: flagged_block(flagged_block(x, w), w).pow(2).sum(), x, w)
    for policy in DIVERGENCE_POLICIES:
        region = engine.remat(outer, policy=policy)
        found = engine.grads(lambda x, w, r=region: r(x, w).pow(2).sum(), x, w)  # type: ignore[misc]
        assert_close_each(found, expected)


# -- Hugging Face GPT-2 in training, default use_cache ------------------------------


def _gpt2(policy: str | None) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32
    )
    model = transformers.GPT2Model(config).train()
    if policy is not None:
        remat.apply(model, policy=policy, where=GPT2Block)
    return model  # type: ignore[no-any-return]


def _gpt2_grads(engine: Engine, model: torch.nn.Module, **kwargs: Any) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    params = dict(model.named_parameters())
    if engine.name == "eager":
        torch.manual_seed(1)  # the same dropout masks in every run
        model(ids, **kwargs).last_hidden_state.pow(2).mean().backward()
        return {name: p.grad for name, p in params.items() if p.grad is not None}

    def loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
        torch.manual_seed(1)
        out = torch.func.functional_call(model, params, (ids,), kwargs)
        return out.last_hidden_state.pow(2).mean()  # type: ignore[no-any-return]

    return torch.func.grad(loss)(params)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def gpt2_reference() -> dict[str, torch.Tensor]:
    """GPT-2's gradients without remat (computed once for the module)."""
    return _gpt2_grads(Engine("functional"), _gpt2(None), use_cache=False)


@pytest.mark.parametrize("policy", ("nothing-saveable", "dots-saveable"))
def test_gpt2_with_its_default_cache_raises_and_use_cache_false_fixes(
    engine: Engine, policy: str, gpt2_reference: dict[str, torch.Tensor]
) -> None:
    expected = gpt2_reference
    with pytest.raises(remat.NondeterministicRecomputeError) as info:
        _gpt2_grads(engine, _gpt2(policy))
    message = str(info.value)
    assert re.search(r"GPT2Block\.forward \(.*modeling_gpt2\.py:\d+\)", message)
    assert "use_cache=False" in message and "determinism_check=False" not in message

    found = _gpt2_grads(engine, _gpt2(policy), use_cache=False)
    assert found.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(found[name], grad, rtol=1e-5, atol=1e-6, msg=name)


# Eager save-last is not a case: it recomputes the first region without replay
# (no kept op whose shapes could be checked), so determinism_check=False leaves
# nothing to check there.
@pytest.mark.parametrize(
    ("engine_name", "policy"),
    [("eager", "dots-saveable"), ("functional", "dots-saveable"), ("functional", "save-last")],
)
def test_a_replay_given_other_shapes_raises_without_the_determinism_check(
    engine_name: str, policy: str
) -> None:
    """``determinism_check=False`` skips the signature checks, never the replay's shapes."""
    engine = Engine(engine_name)
    x, w = _inputs()
    program, region_fn = _cache_program(  # type: ignore[arg-type]
        lambda f: engine.remat(f, policy=policy, determinism_check=False)  # type: ignore[return-value]
    )
    _raises_naming(engine, program, region_fn, x, w)


def pair_or_single(x: torch.Tensor, w: torch.Tensor, pair: bool | None = None) -> Any:
    """Same ops either way; the flag changes only the output structure."""
    y = (x @ w).sin()
    return (y, y * 0) if (_FLAG["sin"] if pair is None else pair) else (y,)


def test_another_output_structure_is_right_or_raises_and_an_argument_fixes(
    engine: Engine,
) -> None:
    def program_of(block: Fn, pass_flag: bool = False) -> Fn:
        def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            _FLAG["sin"] = True
            out = block(x, w, pair=True) if pass_flag else block(x, w)
            _FLAG["sin"] = False
            return out[0].pow(2).sum()  # type: ignore[no-any-return]

        return program

    x, w = _inputs()
    expected = _reference(program_of(pair_or_single), x, w)
    region = engine.remat(pair_or_single)
    if engine.name == "eager":  # saved tensors match: the outputs are the forward's
        assert_close_each(engine.grads(program_of(region), x, w), expected)  # type: ignore[arg-type]
    else:  # the recompute's outputs are differentiated: they must have the same structure
        message = _raises_naming(engine, program_of(region), pair_or_single, x, w)  # type: ignore[arg-type]
        assert "static_argnums/static_argnames" in message
    fixed = engine.remat(pair_or_single, static_argnames=("pair",))
    assert_close_each(engine.grads(program_of(fixed, pass_flag=True), x, w), expected)  # type: ignore[arg-type]


# -- code the forward runs alone, under ``not remat.is_recomputing()`` -----------

_LOG: list[torch.Tensor] = []


def logging_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    if not remat.is_recomputing():  # as the docs recommend for side effects
        _LOG.append((h * 2).detach().sum())
    return h.sin()


# Policies that record ops replay them in order: there the torch.func engine (which
# recomputes the whole function) still calls such a skipped op a divergence.
@pytest.mark.parametrize("policy", ("nothing-saveable",))
def test_forward_only_side_effects_are_no_divergence(engine: Engine, policy: str) -> None:
    x, w = _inputs()
    expected = _reference(lambda x, w: logging_block(x, w).pow(2).sum(), x, w)
    block = engine.remat(logging_block, policy=policy)
    _LOG.clear()
    assert_close_each(engine.grads(lambda x, w: block(x, w).pow(2).sum(), x, w), expected)  # type: ignore[operator]
    assert len(_LOG) == 1  # the forward logged once; the recompute skipped it
