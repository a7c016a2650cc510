"""Random programs with forward-only side computations: no remat's gradients, or a raise.

NOTE [ Ops the recompute may skip ] in ``remat/_replay/alignment.py``. A program
is a chain of matmuls and activations with optional side computations that only
the forward runs (statistics read by ``.item()``, some with the chain's matmul
shapes), constants built on the first call, and statistics both runs compute.
Those must never raise and always match no remat. A step that only the forward
runs on the gradient path changes the gradients: it must raise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import remat

_N = 6
_W = [torch.randn(_N, _N, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
      for k in range(3)]

#: Steps on the gradient path; side computations; a gradient step only the forward runs.
_PATH = ("mm0", "mm1", "mm2", "tanh", "sin")
_SIDE = ("norm", "stat_mm0", "stat_mm1", "mean", "lazy", "both")
#: Statistics autograd records (on ``h`` itself): the eager engine's recompute saves
#: fewer tensors (NOTE [ Saved tensors the recompute may skip ]).
_RECORDED = ("grad_norm", "grad_stat_mm0", "grad_stat_mm1", "grad_mean")
_FORWARD_ONLY_PATH = "forward_only_mm"

#: Policies that record ops, and one that records none.
_POLICIES = ("dots-saveable", "budget:0.3", "save:hidden", "nothing-saveable")


def _program(steps: list[str]) -> Callable[..., torch.Tensor]:
    cache: dict[str, torch.Tensor] = {}
    seen: list[float] = []

    def f(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        h = x @ ws[2]  # the output depends on a weight, whatever the steps
        for i, step in enumerate(steps):
            if step.startswith("mm"):
                h = h @ ws[int(step[2])]
            elif step in ("tanh", "sin"):
                h = remat.checkpoint_name(getattr(torch, step)(h), "hidden")
            elif step == "both":
                seen.append(h.detach().abs().sum().item())
            elif step == "lazy":
                if str(i) not in cache:
                    cache[str(i)] = torch.arange(1, _N + 1, dtype=torch.float64) / _N
                h = h * cache[str(i)]
            elif step == _FORWARD_ONLY_PATH:
                if not remat.is_recomputing():
                    h = torch.tanh(h @ ws[0])
            elif step in _RECORDED:
                if not remat.is_recomputing():
                    if step == "grad_norm":
                        seen.append(h.norm().item())
                    elif step == "grad_mean":
                        seen.append(h.mean().item())
                    else:
                        seen.append((h @ ws[int(step[-1])]).sum().item())
            elif not remat.is_recomputing():
                d = h.detach()
                if step == "norm":
                    seen.append(d.norm().item())
                elif step == "mean":
                    seen.append(d.mean().item())
                else:  # reads a weight: autograd must not record it (NOTE rule 1)
                    with torch.no_grad():
                        seen.append((d @ ws[int(step[-1])]).sum().item())
        return h

    return f


def _grads(
    fn: Callable[..., torch.Tensor], policy: str | None, engine: str
) -> tuple[torch.Tensor, ...]:
    x = torch.randn(3, _N, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    ws = [w.clone() for w in _W]
    if policy is None:
        leaves = [w.requires_grad_() for w in ws]
        return torch.autograd.grad(fn(x, *leaves).sum(), leaves, materialize_grads=True)
    region = remat.remat(fn, policy=policy, engine=engine if engine == "eager" else "auto")
    if engine == "eager":
        leaves = [w.requires_grad_() for w in ws]
        return torch.autograd.grad(region(x, *leaves).sum(), leaves, materialize_grads=True)
    out: tuple[torch.Tensor, ...] = torch.func.grad(
        lambda *w: region(x, *w).sum(), argnums=(0, 1, 2)
    )(*ws)
    return out


_steps = st.lists(st.sampled_from(_PATH), min_size=1, max_size=6)


@settings(deadline=None, max_examples=30)
@given(
    path=_steps,
    sides=st.lists(st.tuples(st.integers(0, 6), st.sampled_from(_SIDE)), max_size=4),
    policy=st.sampled_from(_POLICIES),
    engine=st.sampled_from(("eager", "functional")),
)
def test_side_computations_never_change_gradients_nor_raise(
    path: list[str], sides: list[tuple[int, str]], policy: str, engine: str
) -> None:
    steps = list(path)
    for at, side in sides:
        steps.insert(min(at, len(steps)), side)
    expected = _grads(_program(steps), None, engine)
    got = _grads(_program(steps), policy, engine)
    torch.testing.assert_close(got, expected)


@settings(deadline=None, max_examples=40)
@given(
    path=_steps,
    sides=st.lists(st.tuples(st.integers(0, 6), st.sampled_from(_RECORDED + _SIDE)), max_size=4),
    policy=st.sampled_from(_POLICIES),
)
def test_recorded_statistics_never_change_gradients_nor_raise(
    path: list[str], sides: list[tuple[int, str]], policy: str
) -> None:
    # The eager engine. (The torch.func engine's call trace cannot tell a recorded
    # ``h @ W`` statistic from the same later call on the path: it raises there.)
    steps = list(path)
    for at, side in sides:
        steps.insert(min(at, len(steps)), side)
    expected = _grads(_program(steps), None, "eager")
    got = _grads(_program(steps), policy, "eager")
    torch.testing.assert_close(got, expected)


@settings(deadline=None, max_examples=30)
@given(
    path=_steps,
    sides=st.lists(st.tuples(st.integers(0, 6), st.sampled_from(_RECORDED + _SIDE)), max_size=3),
    at=st.integers(0, 6),
    policy=st.sampled_from(_POLICIES[:3]),
    engine=st.sampled_from(("eager", "functional")),
)
def test_a_forward_only_step_on_the_gradient_path_raises(
    path: list[str], sides: list[tuple[int, str]], at: int, policy: str, engine: str
) -> None:
    steps = list(path)
    for where, side in sides:
        steps.insert(min(where, len(steps)), side)
    steps.insert(min(at, len(steps)), _FORWARD_ONLY_PATH)
    try:
        got = _grads(_program(steps), policy, engine)
    except remat.NondeterministicRecomputeError:
        return  # the recompute differs where it matters: raised, as it must
    # No raise: only where the recompute never runs that step's ops again (every
    # value it needs kept), so the gradients are no remat's.
    torch.testing.assert_close(got, _grads(_program(steps), None, engine))
