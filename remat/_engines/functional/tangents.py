"""The tangents of the Function's ``jvp`` rule: under ``torch.func.jvp``, or at the live
eager dual level.

NOTE [ Tangents at the eager dual level ]
1. The ``jvp`` rule (``function.py``) runs ``fn`` again for the tangents of its
   outputs. ``torch.func.jvp`` does that under a functorch ``jvp`` (``jvp``,
   ``jacfwd``, ``hessian``): torch enters the eager dual level only for the
   outermost functorch ``jvp``, and the rule runs inside it.
2. With no functorch ``jvp`` live but an eager ``forward_ad.dual_level`` open
   (``torch.func.linearize`` traces its jvp so; a user's own ``make_dual``),
   ``torch.func.jvp`` would enter a second eager dual level, which torch refuses
   ("Nested forward mode AD is not supported"). The rule then computes at the
   live level instead: forward-mode AD on (torch turns it off inside a ``jvp``
   rule), each moving input's primal made dual with its tangent, the tangents
   read off ``fn``'s outputs. The primals are unpacked first: a saved input
   carries its own tangent at that level already, and making a dual of it is
   refused too.
3. An output no moving input reaches has no tangent there; ``torch.func.jvp``
   gives zeros for it, and so does this rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.autograd.forward_ad as fwAD

from ..._compat import JVP, eager_forward_ad_level, forward_grad_enabled, interpreters

__all__ = ["output_tangents"]


def output_tangents(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    primals: Sequence[torch.Tensor],
    tangents: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """The tangents of ``fn(*primals)`` along ``tangents``, at the live forward-mode level."""
    if not _eager_level_only():
        return tuple(torch.func.jvp(fn, tuple(primals), tuple(tangents))[1])
    with forward_grad_enabled():
        duals = [
            fwAD.make_dual(fwAD.unpack_dual(p).primal, t)
            for p, t in zip(primals, tangents, strict=True)
        ]
        out = fn(*duals)
        found = [fwAD.unpack_dual(o).tangent for o in out]
    return tuple(
        torch.zeros_like(o) if t is None else t for o, t in zip(out, found, strict=True)
    )


def _eager_level_only() -> bool:
    """An eager dual level is open and no functorch ``jvp`` is live (rule 2)."""
    if eager_forward_ad_level() < 0:
        return False
    return not any(i.key() == JVP for i in interpreters())
