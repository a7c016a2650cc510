"""Forward mode at the eager dual level (``torch.func.linearize``, ``forward_ad.make_dual``),
and functorch's forward mode with ``engine="functional"`` asked for by name.

NOTE [ Tangents at the eager dual level ] (``_engines/functional/tangents.py``):
``torch.func.jvp`` inside an open eager dual level is refused by torch ("Nested
forward mode AD"), so the torch.func engine's jvp rule computes at that level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from helpers import CORE_POLICIES, F64
from torch.func import hessian, jacfwd, jvp, linearize

import remat

POLICIES = (*CORE_POLICIES, "offload-dots")
ENGINES = ("functional", "eager", "auto")


def _program(recomputes: list[bool]) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        recomputes.append(remat.is_recomputing())
        h = torch.tanh(remat.checkpoint_name(x @ w, "hidden"))
        return h.sin() @ w, (h * h).sum()

    return f


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x, w = torch.randn(5, 6, dtype=F64), torch.randn(6, 6, dtype=F64)
    return x, w, w.cos()


def _linearized(f: Callable[..., Any], x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Any:
    out, jvp_fn = linearize(lambda v: f(x, v), w)
    return out, jvp_fn(t), jvp_fn(2 * t)  # the traced jvp, called twice


def _made_dual(f: Callable[..., Any], x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Any:
    with fwAD.dual_level():
        out = f(x, fwAD.make_dual(w, t))
        return [fwAD.unpack_dual(o) for o in out]


@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node")  # torch's const folding
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("how", ["linearize", "make_dual"])
def test_forward_mode_at_the_eager_dual_level(how: str, engine: str, policy: str) -> None:
    run = _linearized if how == "linearize" else _made_dual
    x, w, t = _inputs()
    want = run(_program([]), x, w, t)
    recomputes: list[bool] = []
    got = run(remat.remat(_program(recomputes), policy=policy, engine=engine), x, w, t)
    optree.tree_map(torch.testing.assert_close, tuple(got), tuple(want))
    forwards = 2 if how == "linearize" else 1  # linearize runs fn, then traces its jvp
    # auto picks the eager engine here (no functorch transform is live): saved-tensor
    # hooks and forward AD compose, nothing runs again. The torch.func engine's jvp
    # rule runs fn once more per dual forward, for the tangents.
    again = 1 if engine == "functional" else 0
    assert recomputes.count(False) == forwards, recomputes
    assert recomputes.count(True) == again, recomputes


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("engine", ["functional", "eager"])
def test_forward_and_reverse_in_one_dual_level(engine: str, policy: str) -> None:
    # A tangent and a gradient of the same forward, the backward after the level
    # exits. The torch.func engine: the jvp rule at the live level, the backward's
    # recompute outside forward AD. The eager engine: autograd recorded the tangent
    # ops too, whose saved tensors went with the tangents; the recompute leaves them
    # out (NOTE [ Saved tensors the recompute may skip ]).
    x, w, t = _inputs()

    def both(f: Callable[..., Any], hold: bool) -> tuple[torch.Tensor, torch.Tensor]:
        kept: list[torch.Tensor] = []
        leaf = w.clone().requires_grad_()
        with fwAD.dual_level():
            out, total = f(x, fwAD.make_dual(leaf, t))
            kept.append(fwAD.unpack_dual(out).tangent)
        # The tangent's own graph (it depends on ``leaf``): kept while ``kept`` holds it.
        tangent = kept.pop().detach() if not hold else kept[-1].detach()
        (g,) = torch.autograd.grad(out.sum() + total, leaf)
        return tangent, g

    want = both(_program([]), False)
    if engine == "eager" and policy != "save-last":
        # A tangent kept keeps the saved tensors of its graph: backward may read them,
        # and the recompute cannot give them. It raises; the tangent let go, it works.
        region = remat.remat(_program([]), policy=policy, engine=engine)
        with pytest.raises(remat.NondeterministicRecomputeError, match="saved tensor"):
            both(region, True)
    recomputes: list[bool] = []
    region = remat.remat(_program(recomputes), policy=policy, engine=engine)
    got = both(region, engine == "functional")  # kept: the torch.func engine does not mind
    optree.tree_map(torch.testing.assert_close, got, want)
    assert recomputes.count(False) == 1, recomputes
    if engine == "functional":  # the tangents' run, and the backward's unless held
        assert recomputes.count(True) >= 1, recomputes
    else:  # none; or the in-place recompute that failed (with an op log, its rerun
        # with every op), then the one that leaves the tangent ops' saved tensors out
        runs = {"save-last": 0, "nothing-saveable": 2}.get(policy, 3)
        assert recomputes.count(True) == runs, recomputes


def _functorch_forward(kind: str, f: Callable[..., Any], x: torch.Tensor, w: torch.Tensor) -> Any:
    def total(v: torch.Tensor) -> torch.Tensor:
        out, s = f(x, v)
        return out.sum() + s

    if kind == "jvp":
        return jvp(lambda v: f(x, v), (w,), (w.cos(),))
    if kind == "jacfwd":
        return jacfwd(lambda v: f(x, v)[0])(w)
    return hessian(total)(w)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["jvp", "jacfwd", "hessian"])
def test_functorch_forward_mode_with_the_functional_engine_named(kind: str, policy: str) -> None:
    x, w, _ = _inputs()
    want = _functorch_forward(kind, _program([]), x, w)
    recomputes: list[bool] = []
    region = remat.remat(_program(recomputes), policy=policy, engine="functional")
    got = _functorch_forward(kind, region, x, w)
    optree.tree_map(torch.testing.assert_close, got, want)
    assert recomputes[0] is False and recomputes.count(False) == 1, recomputes
    assert recomputes.count(True) >= 1, recomputes
