"""The eager engine's fixed per-op cost (issue 17 item 1), with every check kept.

Outside ``torch.compile`` no hook, op or detach goes through ``torch.compiler.disable``;
the detaches in the saved-tensor hooks skip remat's own modes only: a user's mode
and a tensor subclass still see them. Counted in calls, not time.
"""

from __future__ import annotations

import cProfile
import pstats

import pytest
import torch
from helpers import POLICIES, assert_close_all, grads
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import _demo_model as demo
from remat._replay import modes
from remat._replay.records import OpLog
from remat._replay.tags import tag_of

_DETACH = torch.ops.aten.detach.default


def _calls(step: object, name: str, filename: str) -> int:
    profile = cProfile.Profile()
    profile.runcall(step)  # type: ignore[arg-type]
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return sum(
        entry[1] for (file, _, function), entry in stats.items()
        if function == name and file.endswith(filename)
    )


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_no_dynamo_disable_per_hook_or_op_outside_compile(policy: str) -> None:
    model = demo.Stack(depth=2, width=8, heads=2)
    x = demo.make_input(model, batch=2, seq=4)

    def step() -> None:
        model.loss(x, policy).backward()

    step()  # warm: the policy resolves, the runners are built
    # torch.compiler.disable's wrapper (eval_frame.py's _fn), per hook and per op before.
    assert _calls(step, "_fn", "eval_frame.py") == 0
    # The checkpoint equivalent makes its own such calls: the count above can see them.
    assert _calls(lambda: model.loss(x, demo.TORCH_CHECKPOINT).backward(), "_fn",
                  "eval_frame.py") > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_unchanged_on_the_demo_stack(policy: str) -> None:
    model = demo.Stack(depth=2, width=8, heads=2)
    x = demo.make_input(model, batch=2, seq=4).requires_grad_()
    params = list(model.parameters())
    expected = grads(lambda x, *_: model.loss(x, demo.NO_REMAT), [x, *params])
    actual = grads(lambda x, *_: model.loss(x, policy), [x, *params])
    assert_close_all(actual, expected)


class _Detaches(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func is _DETACH
        return func(*args, **(kwargs or {}))


def test_detached_passes_the_tag_on_and_shares_the_version_counter() -> None:
    log = OpLog(remat.policies.resolve("dots-saveable"), "f")
    x = torch.randn(3, 3)
    with modes.RecordMode(log):
        y = x.mm(x)
        alias = modes.detached(y)
    assert tag_of(alias) == tag_of(y) is not None
    alias.add_(1)  # an in-place write through the alias is seen on the source
    assert y._version == alias._version == 1


def test_detached_outside_record_mode_adds_no_tag() -> None:
    y = torch.randn(2)
    y.remat_probe = 1  # type: ignore[attr-defined]
    assert tag_of(modes.detached(y)) is None


def test_a_users_mode_still_sees_the_detach() -> None:
    log = OpLog(remat.policies.resolve("dots-saveable"), "f")
    x = torch.randn(3, 3)
    with _Detaches() as seen, modes.RecordMode(log):
        y = x.mm(x)  # the mode keeps mm's output: a detach below it
        before = seen.count
        alias = modes.detached(y)
    assert seen.count == before + 1 and tag_of(alias) == tag_of(y) is not None


def test_a_users_mode_around_a_region_keeps_its_gradients() -> None:
    w = torch.randn(4, 4, requires_grad=True)
    f = remat.remat(lambda x: (x @ w).sin().sum(), policy="dots-saveable")
    x = torch.randn(4, 4)
    (expected,) = torch.autograd.grad((x @ w).sin().sum(), w)
    with _Detaches() as seen:
        (actual,) = torch.autograd.grad(f(x), w)
    torch.testing.assert_close(actual, expected)
    assert seen.count > 0  # the engine's detaches went through the user's mode


class _Wrapper(torch.Tensor):
    """A wrapper subclass that counts the detaches dispatched to it."""

    detaches = 0

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, dtype=inner.dtype, requires_grad=inner.requires_grad
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _DETACH:
            cls.detaches += 1
        unwrap = [a.inner if isinstance(a, _Wrapper) else a for a in args]
        out = func(*unwrap, **(kwargs or {}))
        return _Wrapper(out) if isinstance(out, torch.Tensor) else out


def test_a_tensor_subclass_still_sees_the_detach() -> None:
    t = _Wrapper(torch.randn(3))
    before = _Wrapper.detaches
    log = OpLog(remat.policies.resolve("dots-saveable"), "f")
    with modes.RecordMode(log):
        alias = modes.detached(t)
    assert isinstance(alias, _Wrapper) and _Wrapper.detaches == before + 1


def _walks(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    from remat._engines.eager import outside

    walked: list[object] = []
    real = outside.find_closed_over

    def counting(fn: object) -> object:
        walked.append(fn)
        return real(fn)  # type: ignore[arg-type]

    monkeypatch.setattr(outside, "find_closed_over", counting)
    return walked


def test_no_walk_of_the_closure_for_non_differentiable_outputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Layer norm saves its mean and rstd, attention its log-sum-exp: no grad_fn,
    # made in the region, referenced by autograd's graph only.
    walked = _walks(monkeypatch)
    model = demo.Stack(depth=2, width=8, heads=2)
    model.loss(demo.make_input(model, batch=2, seq=4), "nothing-saveable").backward()
    assert walked == []


def test_a_closed_over_tensor_is_still_found_and_its_mutation_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    walked = _walks(monkeypatch)
    scale = torch.rand(4) + 0.5  # closed over, no grad: autograd saves it for mul

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * scale).sum()

    x = torch.randn(4, requires_grad=True)
    out = remat.remat(f, policy="nothing-saveable")(x)
    assert walked == [f]
    scale.add_(1)
    with pytest.raises(remat.SavedInputMutatedError, match="closure variable 'scale'"):
        out.backward()
    # The fix the message names: modify it after the backward.
    scale.sub_(1)
    out = remat.remat(f, policy="nothing-saveable")(x)
    (g,) = torch.autograd.grad(out, x)
    torch.testing.assert_close(g, x.cos() * scale)
