"""Module helpers: `wrap`, `unwrap`, `apply`, `sequential`, and module state in recompute."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import remat
from remat import apply, is_wrapped, register_stateful, sequential, unwrap, wrap
from remat._inspect.memory import MemoryMeter


def _has_functional_engine() -> bool:
    try:
        import remat._engines.functional  # noqa: F401
    except ImportError:
        return False
    return True


class Counted(nn.Module):
    """A layer that counts its forward calls (real forwards and recomputes)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x))


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y)


# -- sequential: call pattern and gradients ---------------------------------------


def _layer_calls(run: Callable[[list[nn.Module], torch.Tensor], torch.Tensor], n: int) -> Any:
    torch.manual_seed(0)
    layers = [Counted() for _ in range(n)]
    x = torch.randn(3, 4, requires_grad=True)
    run(layers, x).sum().backward()
    grads = [p.grad.clone() for layer in layers for p in layer.parameters()] + [x.grad]
    return [layer.calls for layer in layers], grads


CASES = [(n, s) for n in (4, 6, 7) for s in range(1, n + 1)]


@pytest.mark.parametrize(("n", "segments"), CASES)
def test_sequential_call_pattern_matches_checkpoint_sequential(n: int, segments: int) -> None:
    def torch_run(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint_sequential(
            nn.Sequential(*layers), segments, x, use_reentrant=False
        )

    plain, reference = _layer_calls(lambda layers, x: nn.Sequential(*layers)(x), n)
    expected, _ = _layer_calls(torch_run, n)
    save_last, grads_last = _layer_calls(lambda L, x: sequential(L, x, segments=segments), n)
    nothing, grads_nothing = _layer_calls(
        lambda L, x: sequential(L, x, segments=segments, policy="nothing-saveable"), n
    )
    assert plain == [1] * n
    # Every segment is a region, but save-last keeps the last one: torch's pattern.
    assert save_last == expected
    assert nothing == [2] * n
    _assert_same(grads_last, reference)
    _assert_same(grads_nothing, reference)


def test_sequential_documented_patterns() -> None:
    calls, _ = _layer_calls(lambda L, x: sequential(L, x, segments=3), 6)
    assert calls == [2, 2, 2, 2, 1, 1]
    calls, _ = _layer_calls(lambda L, x: sequential(L, x, segments=3), 7)
    assert calls == [2, 2, 2, 2, 1, 1, 1]
    calls, _ = _layer_calls(lambda L, x: sequential(L, x, segments=4), 4)
    assert calls == [2, 2, 2, 1]


def test_sequential_accepts_containers_callables_and_pytrees() -> None:
    def split(x: torch.Tensor) -> dict[str, Any]:
        return {"a": x.sin(), "b": (x.cos(), "tag")}

    def join(tree: dict[str, Any]) -> torch.Tensor:
        assert tree["b"][1] == "tag"
        return tree["a"] * tree["b"][0]

    linear = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    for layers in ([linear, split, join], nn.ModuleList([linear, nn.Tanh()])):
        run = layers if isinstance(layers, list) else list(layers)
        expected = x
        for layer in run:
            expected = layer(expected)
        (gx_ref,) = torch.autograd.grad(expected.sum(), x)
        for segments in (1, 2, 3)[: len(run)]:
            y = sequential(layers, x, segments=segments, policy="nothing-saveable")
            torch.testing.assert_close(y, expected)
            (gx,) = torch.autograd.grad(y.sum(), x)
            torch.testing.assert_close(gx, gx_ref)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    torch.testing.assert_close(sequential(net, x, segments=2), net(x))


def test_sequential_rejects_bad_segments() -> None:
    with pytest.raises(
        ValueError, match=r"segments must be between 1 and the number of layers \(2\), got 3"
    ):
        sequential([nn.Identity(), nn.Identity()], torch.ones(1), segments=3)
    with pytest.raises(TypeError, match="layer 1 is not callable"):
        sequential([nn.Identity(), 3], torch.ones(1))  # type: ignore[list-item]


# -- memory: save-last recomputes less, at the same peak -----------------------------


def _measure(policy: str, segments: int) -> tuple[int, int]:
    torch.manual_seed(0)
    layers = [Counted(32) for _ in range(8)]
    x = torch.randn(256, 32, requires_grad=True)  # activations dominate the weights
    with MemoryMeter() as meter:  # peak: bytes of the tensors created under it
        sequential(layers, x, segments=segments, policy=policy).sum().backward()
    recomputed = sum(layer.calls - 1 for layer in layers)
    return meter.peak, recomputed


@pytest.mark.parametrize("segments", [2, 4, 8])
def test_save_last_recomputes_all_but_the_last_segment(segments: int) -> None:
    assert _measure("nothing-saveable", segments)[1] == 8
    assert _measure("save-last", segments)[1] == 8 - 8 // segments
    assert _measure("everything-saveable", segments)[1] == 0


@pytest.mark.parametrize("segments", [2, 4, 8])
def test_save_last_has_the_peak_of_nothing_saveable(segments: int) -> None:
    peak_last, _ = _measure("save-last", segments)
    peak_nothing, _ = _measure("nothing-saveable", segments)
    assert peak_last == peak_nothing


# -- wrap ----------------------------------------------------------------------------


class KwargsModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(
        self, x: torch.Tensor, *, scale: float = 1.0, extra: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, str, int, dict[str, Any]]:
        y = torch.sin(self.linear(x)) * scale
        if extra is not None:
            y = y + extra.cos()
        return y, "label", 7, {"none": None, "h": y.exp()}


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_wrap_kwargs_and_non_tensor_outputs(policy: str) -> None:
    torch.manual_seed(0)
    module = KwargsModule()
    x = torch.randn(2, 3, requires_grad=True)
    extra = torch.randn(2, 3, requires_grad=True)

    def loss(out: tuple[torch.Tensor, str, int, dict[str, Any]]) -> torch.Tensor:
        y, label, seven, tree = out
        assert (label, seven, tree["none"]) == ("label", 7, None)
        return (y * tree["h"]).sum()

    loss(module(x, scale=2.0, extra=extra)).backward()
    reference = [*_grads(module), x.grad.clone(), extra.grad.clone()]
    module.zero_grad()
    x.grad = extra.grad = None
    assert wrap(module, policy=policy) is module
    loss(module(x, scale=2.0, extra=extra)).backward()
    _assert_same([*_grads(module), x.grad, extra.grad], reference)


def test_wrap_recomputes_and_keeps_state_dict() -> None:
    module = Counted()
    keys = list(module.state_dict())
    wrap(module)
    assert list(module.state_dict()) == keys
    module(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert module.calls == 2
    # no_grad (inference): one plain call.
    with torch.no_grad():
        module(torch.randn(2, 4))
    assert module.calls == 3


def test_wrap_is_idempotent_and_rewraps_with_new_policy() -> None:
    module = Counted()
    wrap(module)
    first = module.forward
    wrap(module)
    assert module.forward is not first and is_wrapped(module)
    wrap(module, policy="everything-saveable")
    module(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert module.calls == 1  # the new policy keeps everything: no recompute
    unwrap(module)
    assert "forward" not in module.__dict__  # one unwrap undoes any number of wraps


def test_unwrap_restores_exactly() -> None:
    model = nn.Sequential(Counted(), nn.Sequential(Counted(), nn.ReLU()))
    custom = model[1][0].forward
    model[1][0].forward = custom  # an instance attribute the user set before wrapping
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    apply(model, where=lambda name, m: name in ("0", "1.0"))
    wrap(model[1])  # contains a wrapped module: unwrap(model) undoes both
    assert unwrap(model) is model
    after = {name: dict(vars(m)) for name, m in model.named_modules()}
    assert after == before
    assert model[1][0].forward is custom


def _collected_without_gc(backward: bool) -> bool:
    module = wrap(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    out = module(torch.randn(3, 4, requires_grad=True)).sum()
    if backward:
        out.backward()
    del out
    ref = weakref.ref(module)
    gc.disable()
    try:
        del module
        return ref() is None  # reference counting alone frees it: no cycle
    finally:
        gc.enable()
        gc.collect()
        assert ref() is None  # and it is collectable in any case


def test_wrapped_module_has_no_reference_cycle() -> None:
    assert _collected_without_gc(backward=False)


def test_wrapped_module_has_no_reference_cycle_after_backward() -> None:
    assert _collected_without_gc(backward=True)


def test_wrap_deepcopy_points_at_the_copy() -> None:
    module = wrap(Counted())
    clone = copy.deepcopy(module)
    clone(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert (clone.calls, module.calls) == (2, 0)
    assert clone.linear.weight.grad is not None and module.linear.weight.grad is None


def test_wrap_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"remat\.wrap: expected an nn\.Module, got function"):
        wrap(lambda x: x)  # type: ignore[type-var]
    with pytest.raises(ValueError, match="dots-savable"):
        wrap(nn.Linear(2, 2), policy="dots-savable")
    assert not is_wrapped(nn.Linear(2, 2))


def test_wrap_forward_hooks_run_once() -> None:
    module = wrap(Counted())
    seen: list[int] = []
    module.register_forward_hook(lambda m, args, out: seen.append(1))
    module(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert seen == [1] and module.calls == 2


# -- module state: BatchNorm ---------------------------------------------------------


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6),
        nn.BatchNorm1d(6),
        nn.ReLU(),
        nn.Linear(6, 6),
        nn.BatchNorm1d(6, momentum=None),
    )


def _bn_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num" in k}


def _bn_step(
    model: nn.Module, run: Callable[[nn.Module, torch.Tensor], torch.Tensor], train: bool
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    model.train(train)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    run(model, x).pow(2).sum().backward()
    return _bn_state(model), [*_grads(model), x.grad]


RUNS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "wrap": lambda m, x: wrap(m)(x),
    "wrap-dots": lambda m, x: wrap(m, policy="dots-saveable")(x),
    "apply-bn": lambda m, x: apply(m, where=nn.BatchNorm1d)(x),
    "sequential": lambda m, x: sequential(m, x, segments=2, policy="nothing-saveable"),
    "sequential-save-last": lambda m, x: sequential(m, x, segments=5),
    # An outer plain region over a model whose BatchNorms are wrapped.
    "nested": lambda m, x: remat.remat(apply(m, where=nn.BatchNorm1d))(x),
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("how", list(RUNS))
def test_batchnorm_stats_update_once(how: str, train: bool) -> None:
    expected_state, expected_grads = _bn_step(_bn_model(), lambda m, x: m(x), train)
    state, grads = _bn_step(_bn_model(), RUNS[how], train)
    assert state.keys() == expected_state.keys()
    for key in state:
        assert torch.equal(state[key], expected_state[key]), key
    _assert_same(grads, expected_grads)
    if train:
        assert int(state["1.num_batches_tracked"]) == 1


def test_plain_remat_of_a_module_updates_batchnorm_once() -> None:
    expected_state, _ = _bn_step(_bn_model(), lambda m, x: m(x), True)
    state, _ = _bn_step(_bn_model(), lambda m, x: remat.remat(m)(x), True)
    assert int(state["1.num_batches_tracked"]) == 1
    for key in state:
        assert torch.equal(state[key], expected_state[key]), key


def test_torch_checkpoint_updates_batchnorm_twice() -> None:
    """The bug this library fixes, as a regression marker for torch's behavior."""
    model = _bn_model()
    x = torch.randn(8, 4)
    torch_checkpoint.checkpoint(model, x, use_reentrant=False).sum().backward()
    assert int(model[1].num_batches_tracked) == 2


def test_user_stateful_modules() -> None:
    class Ema(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.zeros(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training:
                self.mean.mul_(0.5).add_(x.detach().mean(0), alpha=0.5)
            return x.sin()

    x = torch.ones(2, 3, requires_grad=True)
    for mark in ("attribute", "register"):
        module = Ema()
        if mark == "attribute":
            module.remat_stateful = True
        wrap(module)(x).sum().backward()
        if mark == "attribute":
            torch.testing.assert_close(module.mean, torch.full((3,), 0.5))
    # Not marked: updated twice, which is why the hook exists.
    register_stateful(Ema)
    module = Ema()
    wrap(module)(x).sum().backward()
    torch.testing.assert_close(module.mean, torch.full((3,), 0.5))
    with pytest.raises(TypeError, match=r"expected an nn\.Module subclass, got 3"):
        register_stateful(3)  # type: ignore[arg-type]


def test_is_recomputing_guards_python_state() -> None:
    class Logger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.log: list[str] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.log.append("recompute" if remat.is_recomputing() else "forward")
            return x.sin().sin()

    module = wrap(Logger())
    module(torch.ones(2, requires_grad=True)).sum().backward()
    assert module.log == ["forward", "recompute"]


# -- apply ---------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.relu(self.attn(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(4, 2))


def _wrapped(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if is_wrapped(m)]


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (Block, ["0", "1"]),
        (nn.Linear, ["0.attn", "0.mlp.0", "1.attn", "1.mlp.0", "2"]),
        ((Block, nn.Linear), ["0", "1", "2"]),  # Linears inside Blocks: outermost only
        ((nn.GELU, nn.Sequential), [""]),  # the root is a Sequential: it alone
        (lambda name, m: name.endswith("mlp"), ["0.mlp", "1.mlp"]),
        (lambda name, m: name == "", [""]),
        (lambda name, m: False, []),
    ],
    ids=["type", "leaf-type", "tuple-nested", "root", "predicate", "root-predicate", "none"],
)
def test_apply_selects_exactly(where: Any, expected: list[str]) -> None:
    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    reference = _grads(model)
    model.zero_grad()
    assert apply(model, where=where) is model
    assert _wrapped(model) == expected
    model(x).sum().backward()
    _assert_same(_grads(model), reference)


def test_apply_policy_per_match() -> None:
    model = _model()
    apply(model, where=(Block, nn.Linear), policy={Block: "dots-saveable", "2": "save-last"})
    chosen = {name: m.forward.policy for name, m in model.named_modules() if is_wrapped(m)}
    assert chosen == {
        "0": remat.policies.resolve("dots-saveable"),
        "1": remat.policies.resolve("dots-saveable"),
        "2": remat.policies.resolve("save-last"),
    }

    def choose(name: str, module: nn.Module) -> str:
        return "dots-saveable" if name.endswith("attn") else "nothing-saveable"

    apply(unwrap(model), where=lambda n, m: n.endswith(("attn", "mlp")), policy=choose)
    chosen = {name: m.forward.policy for name, m in model.named_modules() if is_wrapped(m)}
    assert chosen["0.attn"] == remat.policies.resolve("dots-saveable")
    assert chosen["1.mlp"] == remat.policies.resolve("nothing-saveable")
    with pytest.raises(KeyError, match="no entry for module '2' of type Linear"):
        apply(_model(), where=(Block, nn.Linear), policy={Block: "dots-saveable"})
    with pytest.raises(TypeError, match="where must be a module type"):
        apply(_model(), where=3)  # type: ignore[arg-type]


# -- torch.func ----------------------------------------------------------------------


@pytest.mark.skipif(not _has_functional_engine(), reason="needs the torch.func engine (issue 3)")
def test_functional_call_grad_and_vmap() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(5, 4)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,)).sum()

    expected = torch.func.grad(loss)(params, x)
    expected_per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    wrap(model, policy="dots-saveable")
    got = torch.func.grad(loss)(params, x)
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for key in params:
        torch.testing.assert_close(got[key], expected[key])
        torch.testing.assert_close(per_sample[key], expected_per_sample[key])
        assert got[key].abs().sum() > 0  # swapped-in parameters get real gradients


def test_wrap_names_an_unknown_option() -> None:
    with pytest.raises(TypeError, match=r"remat\.wrap: unknown option 'polcy'; the options are"):
        wrap(nn.Linear(2, 2), polcy="dots-saveable")
