"""Property test: random programs shaped like real ones, every one right or loud.

Each example builds a small region the way real code writes one: its output in a
container (a dataclass, a namedtuple, a dict subclass such as Hugging Face's
``ModelOutput``, nested dicts), a submodule whose forward hook captures its
output (transformers' ``output_router_logits``), tensors leaving through a global
list or an attribute, a weight it closes over, a cache that grows, a flag flipped
between forward and backward, ``vmap`` with an input that leaves an output
unbatched. It runs under one engine and one way of differentiating, with and
without remat. Every example must either give the no-remat gradients or raise
`remat.RematError`; when plain autograd raises (a saved tensor modified in
place), remat must raise too.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn
from helpers import WIDE_POLICIES
from hypothesis import given, settings
from hypothesis import strategies as st

import remat


@dataclasses.dataclass
class DataOut:
    """An unregistered dataclass, as user code returns."""

    main: torch.Tensor
    aux: torch.Tensor
    note: str = "kept"


class NamedOut(NamedTuple):
    main: torch.Tensor
    aux: torch.Tensor


class DictOut(collections.OrderedDict):  # type: ignore[type-arg]
    """A dict subclass, as Hugging Face's ``ModelOutput`` is."""


def _pack(kind: str, main: torch.Tensor, aux: torch.Tensor) -> Any:
    if kind == "tuple":
        return main, aux
    if kind == "dataclass":
        return DataOut(main, aux)
    if kind == "namedtuple":
        return NamedOut(main, aux)
    if kind == "dict-subclass":
        return DictOut(main=main, aux=aux)
    assert kind == "nested", kind
    return {"out": (main, None, 3), "extra": {"aux": aux, "tag": "t"}}


def _unpack(kind: str, out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if kind in ("tuple", "namedtuple"):
        return out[0], out[1]
    if kind == "dataclass":
        assert out.note == "kept"
        return out.main, out.aux
    if kind == "dict-subclass":
        assert type(out) is DictOut
        return out["main"], out["aux"]
    assert out["out"][1:] == (None, 3) and out["extra"]["tag"] == "t"
    return out["out"][0], out["extra"]["aux"]


STEPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "matmul": lambda h, w: h @ w,
    "tanh": lambda h, w: torch.tanh(h),
    "mul": lambda h, w: h * w,
    "residual": lambda h, w: h + torch.sigmoid(h @ w),
    "softmax": lambda h, w: torch.softmax(h, dim=-1),
    "name": lambda h, w: remat.checkpoint_name(torch.cos(h), "hidden"),
}

#: How the example is differentiated: (engine option, way).
MODES = ["eager", "functional-backward", "grad", "grad-of-vmap", "vjp"]


@dataclasses.dataclass
class Program:
    steps: list[str]
    container: str
    escape: str  # "none" | "hook" | "global" | "attribute"
    divergence: str  # "none" | "op" | "shape"
    mutate_closure: bool
    policy: str
    mode: str
    seed: int


class _Holder:
    last: torch.Tensor | None = None


def _build(p: Program, use_remat: bool) -> tuple[Callable[..., Any], Callable[[], list[Any]],
                                                 nn.Module, torch.Tensor, Callable[[], None]]:
    """The region (or the plain function), what escaped, its module, its scale, a flipper."""
    torch.manual_seed(p.seed)
    inner = nn.Linear(4, 4)
    scale = torch.rand(4) + 0.5
    scale.requires_grad_(p.mode in ("eager", "functional-backward"))
    sink: list[torch.Tensor] = []
    holder = _Holder()
    cache: list[torch.Tensor] = []
    flag = [True]
    if p.escape == "hook":
        inner.register_forward_hook(lambda m, args, out: sink.append(out))

    def body(x: torch.Tensor, w: torch.Tensor) -> Any:
        h = x
        for step in p.steps:
            h = STEPS[step](h, w)
        h = inner(h * scale)
        if p.escape == "global":
            sink.append(torch.tanh(h))
        elif p.escape == "attribute":
            holder.last = torch.sigmoid(h)
        if p.divergence == "op":
            h = torch.sin(h) if flag[0] else torch.cos(h)
        elif p.divergence == "shape":
            cache.append(h @ w)
            keys = torch.cat(cache, dim=-2)
            h = torch.softmax(h @ keys.transpose(-1, -2), dim=-1) @ keys
        return _pack(p.container, h, (w**2).sum())

    def escaped() -> list[Any]:
        return [*sink, *([holder.last] if holder.last is not None else [])]

    def flip() -> None:
        flag[0] = False

    fn: Callable[..., Any] = body
    if use_remat:
        engine = "eager" if p.mode == "eager" else "auto"
        if p.mode == "functional-backward":
            engine = "functional"
        fn = remat.remat(body, policy=p.policy, engine=engine)
    return fn, escaped, inner, scale, flip


def _loss(p: Program, out: Any, escaped: list[Any]) -> torch.Tensor:
    main, aux = _unpack(p.container, out)
    total = main.pow(2).sum() + aux.sum()  # under vmap, aux is one per example
    for e in escaped:
        total = total + 0.5 * e.sum()
    return total


def _run(p: Program, use_remat: bool) -> list[torch.Tensor]:
    fn, escaped, inner, scale, flip = _build(p, use_remat)
    torch.manual_seed(p.seed + 1)
    x = torch.randn(4, 4)
    w = torch.randn(4, 4) * 0.5

    def after_forward() -> None:
        flip()
        if p.mutate_closure:
            with torch.no_grad():
                scale.mul_(3.0)

    if p.mode in ("eager", "functional-backward"):
        xs = [x.requires_grad_(), w.requires_grad_(), scale, *inner.parameters()]
        loss = _loss(p, fn(x, w), escaped())
        after_forward()
        return list(torch.autograd.grad(loss, xs))

    def loss_of(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if p.mode == "grad-of-vmap":
            out = torch.func.vmap(fn, in_dims=(0, None))(x.unsqueeze(1), w)
        else:
            out = fn(x, w)
        return _loss(p, out, escaped())

    if p.mode == "vjp":
        loss, vjp_fn = torch.func.vjp(loss_of, x, w)
        after_forward()
        return list(vjp_fn(torch.ones_like(loss)))
    # torch.func.grad runs forward and backward in one call: flip inside, after the forward.
    def flipped(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        loss = loss_of(x, w)
        after_forward()
        return loss

    return list(torch.func.grad(flipped, argnums=(0, 1))(x, w))


def _programs() -> st.SearchStrategy[Program]:
    def valid(p: Program) -> bool:
        if p.mode == "grad-of-vmap":  # vmap returns tensors only, in torch's pytrees
            return p.container in ("tuple", "namedtuple") and p.escape == "none"
        # functorch itself refuses an in-place write to a captured tensor inside grad.
        return not (p.mode in ("grad", "grad-of-vmap") and p.mutate_closure)

    return st.builds(
        Program,
        steps=st.lists(st.sampled_from(sorted(STEPS)), min_size=0, max_size=4),
        container=st.sampled_from(["tuple", "dataclass", "namedtuple", "dict-subclass", "nested"]),
        escape=st.sampled_from(["none", "none", "hook", "global", "attribute"]),
        divergence=st.sampled_from(["none", "none", "op", "shape"]),
        mutate_closure=st.booleans(),
        policy=st.sampled_from(WIDE_POLICIES),
        mode=st.sampled_from(MODES),
        seed=st.integers(0, 2**16),
    ).filter(valid)


#: What plain autograd raises for a saved tensor modified in place, and what
#: torch.func raises for an in-place write to a tensor the function closes over.
_REFUSALS = ("modified by an inplace operation", "would mutate a captured Tensor")


def _refused(e: BaseException) -> bool:
    return any(text in str(e) for text in _REFUSALS)


def check(p: Program) -> None:
    """The property: remat equals the reference, or raises where the reference is not trusted."""
    try:
        expected: list[torch.Tensor] | None = _run(p, use_remat=False)
    except RuntimeError as e:
        if not _refused(e):
            raise
        expected = None  # plain autograd or torch.func refused an in-place write
    if expected is None:
        with pytest.raises(RuntimeError) as refused:
            _run(p, use_remat=True)
        # Refused too: by a RematError, or by the same check as without remat.
        loud = isinstance(refused.value, remat.RematError) or _refused(refused.value)
        assert loud, f"{p}: {refused.value!r}"
        return
    try:
        actual = _run(p, use_remat=True)
    except remat.RematError:
        return  # loud is allowed; a raw torch error or a wrong value is not
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=lambda m: f"{p}: {m}")


@settings(deadline=None, max_examples=60)
@given(p=_programs())
def test_real_shaped_programs_are_right_or_loud(p: Program) -> None:
    check(p)


def _container_modes() -> list[tuple[str, str]]:
    # vmap itself refuses containers torch's pytrees do not know: no such case.
    every = ["tuple", "dataclass", "namedtuple", "dict-subclass", "nested"]
    return [
        (container, mode)
        for mode in MODES
        for container in (("tuple", "namedtuple") if mode == "grad-of-vmap" else every)
    ]


@pytest.mark.parametrize(("container", "mode"), _container_modes())
def test_every_container_under_every_mode_is_exact(container: str, mode: str) -> None:
    """Without a side channel or a divergence there is nothing to be loud about: exact."""
    p = Program(["matmul", "tanh", "name"], container, "none", "none", False,
                "dots-saveable", mode, 0)
    assert_right = _run(p, use_remat=True)
    for a, e in zip(assert_right, _run(p, use_remat=False), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
