"""`remat.wrap` and `remat.apply` on modules: policies, unwrap, copies, hooks, kwargs.

Every test compares a rematerialized model with the same model run without
remat (same seed, same inputs), over several optimizer steps where state
matters: gradients, parameters and buffers must match. Several of these found
bugs, fixed since: pickling, deepcopy, DataParallel replicas and hooks.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import close_or_none, same_grads, same_state, train_both
from torch import nn

import remat
from remat._modules import is_wrapped

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

    train_both(_blocks, prepare)


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

    train_both(_blocks, prepare)


def test_wrap_twice_with_different_policies() -> None:
    def prepare(m: nn.Module) -> nn.Module:
        remat.wrap(m[0], policy="everything-saveable", determinism_check=False)
        remat.wrap(m[0], policy="nothing-saveable")
        assert m[0].forward.policy == remat.policies.resolve("nothing-saveable")
        # Options are replaced too, not merged: back to the default.
        assert m[0].forward.region.determinism_check is True
        return m

    train_both(_blocks, prepare)


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

    train_both(_blocks, prepare)


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
    close_or_none(block(x), y, "user forward")


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
        same_state(plain, wrapped, step)
        same_state(plain_twin, twin, step)
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
    close_or_none(block(x), x, "copy uses its own parameters")


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
    same_state(source, target, 0)
    buf = io.BytesIO()
    torch.save(target.state_dict(), buf)
    buf.seek(0)
    target.load_state_dict(torch.load(buf))
    train_both(lambda: copy.deepcopy(source), lambda m: target)


def test_pickle_wrapped_model() -> None:
    model = remat.apply(_blocks(), where=Block)
    again = pickle.loads(pickle.dumps(model))
    assert again[0].forward.module_ref() is again[0]
    x = torch.randn(3, 4)
    again.eval()
    model.eval()
    close_or_none(again(x), model(x), "unpickled")


def test_data_parallel_replica_uses_its_own_parameters() -> None:
    module = remat.wrap(nn.Linear(2, 2))
    replica = module._replicate_for_data_parallel()
    replica._parameters = dict(replica._parameters)
    replica._parameters["weight"] = torch.zeros(2, 2, requires_grad=True)
    replica._parameters["bias"] = torch.zeros(2, requires_grad=True)
    close_or_none(replica(torch.ones(1, 2)), torch.zeros(1, 2), "replica output")


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

    train_both(KwModule, lambda m: remat.wrap(m, policy=policy), call=call)


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
    same_grads(ref_model, got_model, 0)
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

    train_both(build, lambda m: remat.wrap(m), call=lambda m, x: m(x, tag="z")["out"])
