"""Adversarial probes of `wrap`/`apply`/`sequential` and module state.

Every probe compares a rematerialized model with the same model run without
remat (same seed, same inputs), over several optimizer steps where state
matters: gradients, parameters and buffers must match. Several of these found
bugs, fixed since: nested stateful modules, pickling, DataParallel replicas,
and modules a function receives or closes over.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat._modules import is_wrapped

# -- helpers -------------------------------------------------------------------


def _close(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is not None and b is not None:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


def _same_state(ref: nn.Module, got: nn.Module, step: int) -> None:
    r, g = ref.state_dict(), got.state_dict()
    assert list(r) == list(g)
    for key in r:
        _close(g[key], r[key], f"step {step}: state {key}")


def _same_grads(ref: nn.Module, got: nn.Module, step: int) -> None:
    for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        _close(q.grad, p.grad, f"step {step}: grad of {name}")


def _train_both(
    build: Callable[[], nn.Module],
    prepare: Callable[[nn.Module], nn.Module],
    *,
    steps: int = 3,
    shape: tuple[int, ...] = (6, 4),
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    eval_between: bool = False,
) -> tuple[nn.Module, nn.Module]:
    """Train ``build()`` plain and ``prepare(build())``; compare after every step."""
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    got = prepare(build())
    _same_state(ref, got, -1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt_g = torch.optim.SGD(got.parameters(), lr=0.1, momentum=0.9)
    run = call or (lambda m, x: m(x))
    for step in range(steps):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(step))
        for m, opt in ((ref, opt_r), (got, opt_g)):
            opt.zero_grad()
            run(m, x).pow(2).sum().backward()
        _same_grads(ref, got, step)
        opt_r.step()
        opt_g.step()
        _same_state(ref, got, step)
        if eval_between:
            ref.eval()
            got.eval()
            with torch.no_grad():
                _close(run(got, x), run(ref, x), f"step {step}: eval output")
            ref.train()
            got.train()
            _same_state(ref, got, step)
    return ref, got


# -- stateful modules ------------------------------------------------------------


def _bn_net(**bn: Any) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(
        nn.Linear(4, 5),
        nn.BatchNorm1d(5, **bn),
        nn.Tanh(),
        nn.Linear(5, 4),
        nn.BatchNorm1d(4, **bn),
    )


BN_VARIANTS = {
    "default": {},
    "cumulative": {"momentum": None},
    "no-running-stats": {"track_running_stats": False},
    "no-affine": {"affine": False, "momentum": None},
}
POLICIES = ["nothing-saveable", "save-last", "dots-saveable", "save-last+dots-saveable"]


@pytest.mark.parametrize("variant", list(BN_VARIANTS))
@pytest.mark.parametrize("policy", POLICIES)
def test_batchnorm_wrap_trains_like_plain(variant: str, policy: str) -> None:
    _train_both(
        _bn_net(**BN_VARIANTS[variant]),
        lambda m: remat.wrap(m, policy=policy),
        eval_between=True,
    )


@pytest.mark.parametrize("variant", list(BN_VARIANTS))
@pytest.mark.parametrize("segments", [1, 2, 3, 5])
@pytest.mark.parametrize("policy", ["save-last", "nothing-saveable"])
def test_batchnorm_sequential_trains_like_plain(variant: str, segments: int, policy: str) -> None:
    _train_both(
        _bn_net(**BN_VARIANTS[variant]),
        lambda m: m,
        call=lambda m, x: (
            remat.sequential(m, x, segments=segments, policy=policy)
            if torch.is_grad_enabled()
            else m(x)
        ),
        eval_between=True,
    )


def test_batchnorm_in_eval_mode_while_training_other_layers() -> None:
    def build() -> nn.Module:
        net = _bn_net(momentum=None)()
        net[1].eval()
        return net

    _train_both(build, lambda m: remat.apply(m, where=nn.Sequential, policy="nothing-saveable"))


def test_syncbatchnorm_single_process() -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 5), nn.SyncBatchNorm(5, momentum=None), nn.Linear(5, 4))

    _train_both(build, lambda m: remat.wrap(m), eval_between=True)


@pytest.mark.parametrize("policy", ["nothing-saveable", "save-last"])
def test_instancenorm_with_running_stats(policy: str) -> None:
    def build() -> nn.Module:
        return nn.Sequential(
            nn.Conv1d(3, 4, 3, padding=1),
            nn.InstanceNorm1d(4, affine=True, track_running_stats=True, momentum=None),
            nn.Conv1d(4, 3, 1),
        )

    _train_both(build, lambda m: remat.wrap(m, policy=policy), shape=(2, 3, 7), eval_between=True)


@remat.register_stateful
class Scaler(nn.Module):
    """Output depends on a buffer the forward advances (a schedule, a step counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x * self.count.clone()).sin()
        self.count.add_(0.5)
        return y


def _scaler_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), Scaler(), nn.Linear(4, 4))


@pytest.mark.parametrize("policy", POLICIES)
def test_registered_stateful_module_trains_like_plain(policy: str) -> None:
    _train_both(_scaler_net, lambda m: remat.wrap(m, policy=policy), eval_between=True)


@pytest.mark.parametrize("segments", [1, 2, 3])
def test_registered_stateful_module_in_sequential(segments: int) -> None:
    _train_both(
        _scaler_net,
        lambda m: m,
        call=lambda m, x: remat.sequential(m, x, segments=segments, policy="nothing-saveable"),
    )


@pytest.mark.parametrize("outer", ["wrap", "sequential"])
def test_nested_wrapped_stateful_module(outer: str) -> None:
    def prepare(m: nn.Module) -> nn.Module:
        remat.wrap(m[1], policy="nothing-saveable")
        return remat.wrap(m, policy="nothing-saveable") if outer == "wrap" else m

    def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if outer == "sequential" and is_wrapped(m[1]):
            return remat.sequential(m, x, policy="nothing-saveable")
        return m(x)

    _train_both(_scaler_net, prepare, call=call, steps=1)


def test_nested_wrapped_batchnorm_updates_once() -> None:
    # BatchNorm's train-mode output does not read its running stats, so the
    # nesting bug above leaves it right: statistics update once, gradients match.
    def prepare(m: nn.Module) -> nn.Module:
        remat.wrap(m[1])
        remat.wrap(m[4], policy="save-last")
        return remat.wrap(m)

    _train_both(_bn_net(momentum=None), prepare, eval_between=True)


# -- apply / wrap / unwrap -------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        self.norm = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.norm(self.inner(x)))


def _blocks() -> nn.Module:
    return nn.Sequential(Block(), Block(), nn.Linear(4, 4))


def test_apply_nested_matches_with_policy_mapping() -> None:
    mapping = {
        "0": "save-last",
        Block: "dots-saveable",
        nn.Sequential: "nothing-saveable",
        nn.Linear: "everything-saveable",
    }

    def prepare(m: nn.Module) -> nn.Module:
        remat.apply(m, where=(Block, nn.Sequential, nn.Linear), policy=mapping)
        # The root Sequential matches, so only it is wrapped (outermost wins).
        assert [n for n, s in m.named_modules() if is_wrapped(s)] == [""]
        return m

    _train_both(_blocks, prepare)


def test_apply_predicate_policy_mapping_by_name_and_type() -> None:
    mapping = {"0": "save-last", Block: "dots-saveable", nn.Linear: "nothing-saveable"}

    def prepare(m: nn.Module) -> nn.Module:
        remat.apply(m, where=lambda name, mod: name != "", policy=mapping)
        wrapped = {n: s.forward.policy for n, s in m.named_modules() if is_wrapped(s)}
        assert list(wrapped) == ["0", "1", "2"]
        assert wrapped["0"] == remat.policies.resolve("save-last")
        assert wrapped["1"] == remat.policies.resolve("dots-saveable")
        assert wrapped["2"] == remat.policies.resolve("nothing-saveable")
        return m

    _train_both(_blocks, prepare)


def test_wrap_twice_with_different_policies() -> None:
    def prepare(m: nn.Module) -> nn.Module:
        remat.wrap(m[0], policy="everything-saveable", determinism_check=False)
        remat.wrap(m[0], policy="nothing-saveable")
        assert m[0].forward.policy == remat.policies.resolve("nothing-saveable")
        # Options are replaced too, not merged: back to the default.
        assert m[0].forward.region.determinism_check is True
        return m

    _train_both(_blocks, prepare)


def test_wrap_twice_changes_recompute_count() -> None:
    calls = []
    block = Block()
    block.inner[0].register_forward_hook(lambda *a: calls.append(1))
    remat.wrap(block, policy="nothing-saveable")
    block(torch.randn(3, 4)).sum().backward()
    assert len(calls) == 2  # forward + recompute
    remat.wrap(block, policy="everything-saveable")
    calls.clear()
    block(torch.randn(3, 4)).sum().backward()
    assert len(calls) == 1


def test_unwrap_then_rewrap() -> None:
    def prepare(m: nn.Module) -> nn.Module:
        remat.apply(m, where=Block, policy="save-last")
        remat.unwrap(m)
        assert not any(is_wrapped(s) for s in m.modules())
        assert "forward" not in m[0].__dict__
        remat.apply(m, where=Block, policy="nothing-saveable")
        return m

    _train_both(_blocks, prepare)


def test_unwrap_keeps_a_user_instance_forward() -> None:
    torch.manual_seed(0)
    block = Block()
    own = block.forward
    block.forward = lambda x: own(x) * 2  # an instance forward the user installed
    before = block.__dict__["forward"]
    remat.wrap(block)
    remat.wrap(block, policy="dots-saveable")
    x = torch.randn(3, 4)
    y = block(x)
    remat.unwrap(block)
    assert block.__dict__["forward"] is before
    _close(block(x), y, "user forward")


def test_deepcopy_then_train_both() -> None:
    torch.manual_seed(0)
    plain = _blocks()
    wrapped = remat.apply(copy.deepcopy(plain), where=Block, policy="save-last")
    twin = copy.deepcopy(wrapped)
    plain_twin = copy.deepcopy(plain)
    assert is_wrapped(twin[0]) and twin[0].forward.module_ref() is twin[0]
    models = [plain, wrapped, plain_twin, twin]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(3):
        # The twins see different data from the originals.
        xs = [
            torch.randn(5, 4, generator=torch.Generator().manual_seed(step + 10 * k))
            for k in (0, 0, 1, 1)
        ]
        for m, opt, x in zip(models, opts, xs, strict=True):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
        _same_state(plain, wrapped, step)
        _same_state(plain_twin, twin, step)
    # Different data, so the copies must have diverged (no shared parameters).
    assert not torch.equal(wrapped[0].out.weight, twin[0].out.weight)


def test_deepcopy_of_a_submodule_of_a_wrapped_model() -> None:
    model = remat.apply(_blocks(), where=Block)
    block = copy.deepcopy(model[1])
    assert block.forward.module_ref() is block
    with torch.no_grad():
        block.out.weight.zero_()
        block.out.bias.zero_()
    x = torch.randn(3, 4)
    _close(block(x), x, "copy uses its own parameters")


@pytest.mark.parametrize("direction", ["wrapped->plain", "plain->wrapped", "wrapped->wrapped"])
def test_state_dict_round_trip(direction: str) -> None:
    torch.manual_seed(0)
    source = _blocks()
    torch.manual_seed(1)
    target = _blocks()
    if direction.startswith("wrapped"):
        remat.apply(source, where=Block)
    if direction.endswith("wrapped"):
        remat.apply(target, where=Block, policy="save-last")
    # Train the source one step so its BatchNorm buffers are non-trivial.
    source(torch.randn(5, 4)).sum().backward()
    target.load_state_dict(source.state_dict())
    _same_state(source, target, 0)
    buf = io.BytesIO()
    torch.save(target.state_dict(), buf)
    buf.seek(0)
    target.load_state_dict(torch.load(buf))
    _train_both(lambda: copy.deepcopy(source), lambda m: target)


def test_pickle_wrapped_model() -> None:
    model = remat.apply(_blocks(), where=Block)
    again = pickle.loads(pickle.dumps(model))
    assert again[0].forward.module_ref() is again[0]
    x = torch.randn(3, 4)
    again.eval()
    model.eval()
    _close(again(x), model(x), "unpickled")


def test_data_parallel_replica_uses_its_own_parameters() -> None:
    module = remat.wrap(nn.Linear(2, 2))
    replica = module._replicate_for_data_parallel()
    replica._parameters = dict(replica._parameters)
    replica._parameters["weight"] = torch.zeros(2, 2, requires_grad=True)
    replica._parameters["bias"] = torch.zeros(2, requires_grad=True)
    _close(replica(torch.ones(1, 2)), torch.zeros(1, 2), "replica output")


# -- sequential ----------------------------------------------------------------


class DictLayer(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.i = i

    def forward(self, state: dict[str, Any]) -> dict[str, Any]:
        h, (a, b) = state["h"], state["pair"]
        h = torch.tanh(self.norm(self.lin(h))) + a * b
        return {"h": h, "pair": (b, h.sum(0)), "depth": state["depth"] + 1}


class Tuple2Dict(nn.Module):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
        return {"h": x[0], "pair": (x[1], x[1] * 2), "depth": 0}


def _pytree_layers() -> nn.Module:
    return nn.Sequential(Tuple2Dict(), *[DictLayer(i) for i in range(5)])


@pytest.mark.parametrize("segments", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("policy", ["save-last", "nothing-saveable", "save-last+dots-saveable"])
def test_sequential_pytree_activations(segments: int, policy: str) -> None:
    def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        inp = (x, x[0] * 0.5)
        out = remat.sequential(m, inp, segments=segments, policy=policy)
        assert out["depth"] == 5
        return out["h"] + out["pair"][1]

    _train_both(_pytree_layers, lambda m: m, call=lambda m, x: call(m, x), steps=2)


def test_sequential_pytree_plain_reference_matches() -> None:
    torch.manual_seed(0)
    m = _pytree_layers()
    x = torch.randn(6, 4)
    a = remat.sequential(m, (x, x[0]), segments=3)
    m.eval()
    with torch.no_grad():
        b = remat.sequential(m, (x, x[0]), segments=3)
    assert a["depth"] == b["depth"] == 5


def _layer_counts(policy: str, segments: int, n: int = 6) -> list[int]:
    counts = [0] * n
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *a, i=i: counts.__setitem__(i, counts[i] + 1))
    remat.sequential(
        layers, torch.randn(2, 4, requires_grad=True), segments=segments, policy=policy
    ).sum().backward()
    return counts


@pytest.mark.parametrize("segments", [1, 2, 3, 6])
def test_sequential_save_last_vs_nothing_saveable_counts(segments: int) -> None:
    size = 6 // segments
    last = 6 - (segments - 1) * size
    assert _layer_counts("save-last", segments) == [2] * (6 - last) + [1] * last
    assert _layer_counts("nothing-saveable", segments) == [2] * 6


# -- save_last across steps ------------------------------------------------------


def _net() -> nn.Module:
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.GELU()) for _ in range(4)]
    )


@pytest.mark.parametrize("policy", ["save-last", "save-last+dots-saveable"])
def test_gradient_accumulation_two_forwards_one_backward(policy: str) -> None:
    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        a = remat.sequential(m, x[:3], segments=4, policy=policy) if m.remat else m(x[:3])
        b = remat.sequential(m, x[3:], segments=4, policy=policy) if m.remat else m(x[3:])
        return torch.cat([a, b])

    def build() -> nn.Module:
        m = _net()
        m.remat = False
        return m

    def prepare(m: nn.Module) -> nn.Module:
        m.remat = True
        return m

    _train_both(build, prepare)


@pytest.mark.parametrize("order", ["first-first", "second-first"])
def test_gradient_accumulation_two_backwards(order: str) -> None:
    torch.manual_seed(0)
    ref = _net()
    got = copy.deepcopy(ref)
    remat.apply(got, where=lambda n, m: n.count(".") == 0 and n != "", policy="save-last")
    x1, x2 = torch.randn(3, 4), torch.randn(3, 4)
    for m in (ref, got):
        l1, l2 = m(x1).pow(2).sum(), m(x2).pow(2).sum()
        for loss in (l1, l2) if order == "first-first" else (l2, l1):
            loss.backward()
    _same_grads(ref, got, 0)
    _same_state(ref, got, 0)


def test_save_last_graph_dropped_then_new_step() -> None:
    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if m.remat:
            # A forward whose graph is dropped without backward (a skipped batch).
            remat.sequential(m, x * 3, segments=4, policy="save-last")
            gc.collect()
            return remat.sequential(m, x, segments=4, policy="save-last")
        m(x * 3)
        return m(x)

    def build() -> nn.Module:
        m = _net()
        m.remat = False
        return m

    def prepare(m: nn.Module) -> nn.Module:
        m.remat = True
        return m

    _train_both(build, prepare)


def test_save_last_wrapped_blocks_with_no_grad_eval_between() -> None:
    _train_both(
        _net,
        lambda m: remat.apply(m, where=lambda n, s: n in {"0", "1", "2", "3"}, policy="save-last"),
        eval_between=True,
        steps=4,
    )


def test_save_last_stack_interleaved_with_no_grad_forward() -> None:
    torch.manual_seed(0)
    ref = _net()
    got = remat.apply(copy.deepcopy(ref), where=lambda n, s: n.isdigit(), policy="save-last")
    x = torch.randn(5, 4)
    for m in (ref, got):
        y = m(x)
        with torch.no_grad():
            m(x + 1)  # a no-grad forward (monitoring) before backward
        y.pow(2).sum().backward()
    _same_grads(ref, got, 0)
    _same_state(ref, got, 0)


# -- calls: kwargs, non-tensor outputs, hooks ------------------------------------


class KwModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(
        self,
        x: torch.Tensor,
        *,
        scale: float = 1.0,
        mask: torch.Tensor | None = None,
        tag: str = "t",
    ) -> dict[str, Any]:
        h = self.norm(self.lin(x)) * scale
        if mask is not None:
            h = h * mask
        return {
            "out": torch.tanh(h),
            "tag": tag,
            "n": h.shape[0],
            "none": None,
            "aux": (h.mean(), [tag * 2]),
        }


@pytest.mark.parametrize("policy", ["nothing-saveable", "save-last", "dots-saveable"])
def test_kwargs_and_non_tensor_outputs(policy: str) -> None:
    mask = torch.rand(6, 4)

    def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m(x, scale=2.0, mask=mask, tag="k")
        assert out["tag"] == "k" and out["n"] == 6 and out["none"] is None
        assert out["aux"][1] == ["kk"]
        return out["out"] + out["aux"][0]

    _train_both(KwModule, lambda m: remat.wrap(m, policy=policy), call=call)


def _hooked(model: nn.Module, log: list[str]) -> None:
    for name, sub in model.named_modules():
        sub.register_forward_pre_hook(lambda *a, n=name: log.append(f"pre {n}"))
        sub.register_forward_hook(lambda *a, n=name: log.append(f"post {n}"))
        sub.register_full_backward_hook(lambda *a, n=name: log.append(f"bwd {n}"))
        sub.register_full_backward_pre_hook(lambda *a, n=name: log.append(f"bwdpre {n}"))


def _hook_log(prepare: Callable[[nn.Module], nn.Module]) -> tuple[list[str], nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    log: list[str] = []
    _hooked(model, log)
    prepare(model)
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    return log, model


@pytest.mark.parametrize("policy", ["nothing-saveable", "save-last", "everything-saveable"])
def test_hooks_on_the_wrapped_module_fire_once(policy: str) -> None:
    ref, ref_model = _hook_log(lambda m: m)
    got, got_model = _hook_log(lambda m: remat.wrap(m[1], policy=policy))
    _same_grads(ref_model, got_model, 0)
    # Hooks of the wrapped module itself and of modules outside it fire as without remat.
    for name in ("", "0", "1"):
        for kind in ("pre", "post", "bwd", "bwdpre"):
            assert got.count(f"{kind} {name}") == ref.count(f"{kind} {name}"), (kind, name)
    # Backward hooks inside the region fire once: the recompute's graph is never run.
    for name in ("1.0", "1.1"):
        for kind in ("bwd", "bwdpre"):
            assert got.count(f"{kind} {name}") == ref.count(f"{kind} {name}") == 1, (kind, name)
        # Forward hooks inside the region may run again in the recompute (as in
        # torch.utils.checkpoint; it stops once backward has what it needs, so a
        # post-hook may not), never when the policy keeps everything.
        pre, post = got.count(f"pre {name}"), got.count(f"post {name}")
        if policy == "everything-saveable":
            assert pre == post == 1, name
        else:
            assert 1 <= post <= pre <= 2, name


def test_forward_pre_hook_changing_kwargs_on_wrapped_module() -> None:
    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        return args, {**kwargs, "scale": 3.0}

    def build() -> nn.Module:
        m = KwModule()
        m.register_forward_pre_hook(hook, with_kwargs=True)
        m.register_forward_hook(lambda mod, a, out: {**out, "out": out["out"] * 2})
        return m

    _train_both(build, lambda m: remat.wrap(m), call=lambda m, x: m(x, tag="z")["out"])


@pytest.mark.parametrize("how", ["closure", "argument"])
def test_remat_of_a_function_running_batchnorm_updates_once(how: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, momentum=None))
    x = torch.randn(4, 3)
    if how == "closure":
        out = remat.remat(lambda x: net(x).tanh())(x)
    else:
        out = remat.remat(lambda model, x: model(x).tanh())(net, x)
    out.sum().backward()
    assert int(net[1].num_batches_tracked) == 1
