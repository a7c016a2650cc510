"""Bad options raise at decoration time, in every entry point, with a fix that works.

Flags are never coerced with ``bool()`` (``preserve_rng_state=None`` used to mean
False and ``"no"`` True); policies that could only fail (or decide nonsense) once an
op runs are refused when given: an aten op where a list of ops is expected, an
uncalled factory, a policy function of the wrong arity, a name list with a space.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import OpCounter
from torch import nn

import remat
from remat import policies as P


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    return (torch.sin(h) @ w).sum()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.lin(x))


def _decorate(api: str, **options: Any) -> Callable[[], tuple[torch.Tensor, ...]]:
    """Apply ``options`` through ``api``; return a function that runs a backward and its grads."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    if api == "remat":
        w = torch.randn(3, 3, requires_grad=True)
        fn = remat.remat(_f, **options)
        return lambda: torch.autograd.grad(fn(x, w), (x, w))
    model = nn.Sequential(_Block(), _Block())
    params = tuple(model.parameters())
    if api == "wrap":
        remat.wrap(model[0], **options)
        return lambda: torch.autograd.grad(model(x).sum(), (x, *params))
    if api == "apply":
        remat.apply(model, where=_Block, **options)
        return lambda: torch.autograd.grad(model(x).sum(), (x, *params))
    assert api == "sequential"
    y = remat.sequential(model, x, segments=2, **options)
    return lambda: torch.autograd.grad(y.sum(), (x, *params))


def _reference(api: str) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    if api == "remat":
        w = torch.randn(3, 3, requires_grad=True)
        return torch.autograd.grad(_f(x, w), (x, w))
    model = nn.Sequential(_Block(), _Block())
    return torch.autograd.grad(model(x).sum(), (x, *model.parameters()))


APIS = ("remat", "wrap", "apply", "sequential")
NAME = {"remat": "remat.remat", "wrap": "remat.wrap", "apply": "remat.apply",
        "sequential": "remat.sequential"}


def _check_fix(api: str, **fixed: Any) -> None:
    for got, want in zip(_decorate(api, **fixed)(), _reference(api), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("flag", ["preserve_rng_state", "debug"])
@pytest.mark.parametrize("bad", [None, 0, 1, "no", "yes"])
def test_bool_flags_are_not_coerced(api: str, flag: str, bad: object) -> None:
    with pytest.raises(TypeError) as info:
        _decorate(api, **{flag: bad})
    message = str(info.value)
    assert message.startswith(f"{NAME[api]}: {flag} must be True or False, got {bad!r}")
    assert f"write {flag}=True or {flag}=False" in message
    for value in (True, False):  # the fix the message gives
        _check_fix(api, **{flag: value})


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(("bad", "error"), [("no", ValueError), ("off", ValueError),
                                            (None, TypeError), (0, TypeError)])
def test_determinism_check_bad_values(api: str, bad: object, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        _decorate(api, determinism_check=bad)
    message = str(info.value)
    assert message.startswith(f"{NAME[api]}: determinism_check must be True, False, 'default'")
    assert f"got {bad!r}" in message and "write determinism_check=True" in message
    _check_fix(api, determinism_check=True)
    _check_fix(api, determinism_check=False)


@pytest.mark.parametrize(("text", "checks"), [("default", True), ("none", False)])
def test_determinism_check_accepts_torch_strings(text: str, checks: bool) -> None:
    scale = [2.0]

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * scale[0]).sum()  # a Python number the recompute sees again

    fn = remat.remat(f, policy="dots-saveable", determinism_check=text)
    assert fn.__remat_region__.determinism_check is checks  # type: ignore[attr-defined]
    x = torch.randn(3, requires_grad=True)
    out = fn(x)
    scale[0] = 3.0  # the recompute now differs from the forward
    if checks:
        with pytest.raises(remat.NondeterministicRecomputeError, match="got the numbers"):
            out.backward()
    else:
        out.backward()  # "none": the difference is expected, not checked
        assert x.grad is not None


def _policy_cases() -> list[tuple[Any, type[Exception], str, Any]]:
    """(bad policy, error, message pattern, the fix the message suggests)."""
    return [
        (torch.ops.aten.mm, TypeError,
         r"got the aten op aten\.mm, not a policy; to save its outputs pass a list of ops: "
         r"policy=\[torch\.ops\.aten\.mm\]", [torch.ops.aten.mm]),
        (torch.ops.aten.addmm.default, TypeError,
         r"got the aten op aten\.addmm\.default, not a policy; .*"
         r"policy=\[torch\.ops\.aten\.addmm\.default\]", [torch.ops.aten.addmm.default]),
        (P.save_only_these_names, TypeError,
         r"got the policy factory remat\.policies\.save_only_these_names itself, not a "
         r"policy; call it, e\.g\. policy=remat\.policies\.save_only_these_names\(\"attn_out\"\)",
         P.save_only_these_names("hidden")),
        (P.offload_dot_with_no_batch_dims, TypeError,
         r"factory remat\.policies\.offload_dot_with_no_batch_dims itself.*"
         r"offload_dot_with_no_batch_dims\(\)", P.offload_dot_with_no_batch_dims()),
        (lambda op: op is torch.ops.aten.mm.default, TypeError,
         r"the policy function _policy_cases\.<locals>\.<lambda>\(op\) cannot be called as "
         r"fn\(op, \*args, \*\*kwargs\).*"
         r"Define it as def policy\(op, \*args, \*\*kwargs\)",
         lambda op, *args, **kwargs: op is torch.ops.aten.mm.default),
        (lambda op, *args: op is torch.ops.aten.mm.default, TypeError,
         r"<lambda>\(op, \*args\) cannot be called as fn\(op, \*args, \*\*kwargs\)",
         lambda op, *args, **kwargs: op is torch.ops.aten.mm.default),
        (_sac_policy, TypeError,
         r"_sac_policy\(ctx, op, \*args, \*\*kwargs\) cannot be called as .*"
         r"selective-checkpoint policy .*from_selective_checkpoint\(_sac_policy\)",
         P.from_selective_checkpoint(_sac_policy)),
        ("save:hidden other", ValueError,
         r"policy 'save:hidden other' has a name with a space in it \('hidden other'\); "
         r"names are separated by commas: write 'save:hidden,other'", "save:hidden,other"),
        ("everything-except:a b,c", ValueError,
         r"write 'everything-except:a,b,c'", "everything-except:a,b,c"),
    ]


def _sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("case", range(len(_policy_cases())))
def test_bad_policies_raise_when_given(api: str, case: int) -> None:
    bad, error, pattern, fix = _policy_cases()[case]
    with pytest.raises(error, match=pattern):
        _decorate(api, policy=bad)
    # remat.apply checks the policy even when no module matches.
    if api == "apply":
        with pytest.raises(error, match=pattern):
            remat.apply(nn.Linear(2, 2), where=_Block, policy=bad)
    _check_fix(api, policy=fix)


def test_suggested_op_list_saves_the_op() -> None:
    """The fix for ``policy=torch.ops.aten.mm`` keeps what it names: no mm is recomputed."""
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    # nothing-saveable recomputes the first mm (the recompute stops before the second)
    for policy, mms in (([torch.ops.aten.mm], 0), ("nothing-saveable", 1)):
        out = remat.remat(_f, policy=policy)(x, w)
        with OpCounter() as counter:
            out.backward()
        # backward itself runs 4 mm (two per matmul)
        assert counter.counts["mm"] == 4 + mms, (policy, counter.counts)


def test_callable_policy_forms_still_accepted() -> None:
    accepted: list[Any] = [
        lambda op, *args, **kwargs: False,
        lambda *args, **kwargs: False,
        lambda op, extra=None, *args, **kwargs: False,
    ]
    for policy in accepted:
        assert isinstance(P.resolve(policy), P.FromCallable)
    assert re.search("from_callable", repr(P.resolve(accepted[0])))
