"""Roots of a backward's ``vjp`` that hold no activation.

NOTE [ The functional engine ] rule 13 (in ``__init__.py``): a backward's
``torch.func.vjp`` keeps the recomputed outputs as the roots of the graph it
differentiates, in its ``vjp_fn``, until that runs. The eager engine's recompute
holds no such thing: only what the region's ops saved. A root needs no values:
autograd starts from its node and checks the cotangent against its shape. So
each recomputed output goes through `_Root`, whose output is one element
broadcast to the output's shape (no memory) and whose backward passes the
cotangent through (made below every mode and level: remat's own tensor,
no op of the region's): the recomputed output itself is freed as soon as nothing
the graph saved reads it, as in the eager engine. Values are never read from a
root (only its ``grad_fn`` and metadata are), so nothing changes but when the
output's storage goes. The price is one custom Function call per output under
functorch, which builds its per-level Function classes each time: callgrind
counts about 2.2M instructions per region's backward (the 8-block stack at
width 16 under ``torch.func.grad``: 189.6M -> 207.5M per step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._compat import GRAD, interpreters
from .levels import _below_all_levels, _forward_ad_active


class _Root(torch.autograd.Function):
    """Identity for autograd; forward gives one element broadcast to the input's shape."""

    @staticmethod
    def forward(t: torch.Tensor) -> torch.Tensor:
        # remat's own tensor: no op of the region's for the replay mode to match.
        with _below_all_levels():
            return t.new_zeros(()).expand(t.shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad


def may_root(keep_graph: bool) -> bool:
    """Whether a backward's recompute may give its ``vjp`` empty roots (`rooted`).

    Only under reverse levels: not where the backward itself is differentiated
    (its graph is kept, rule 4: the roots' backward would be recorded too), not
    under a vmap level (the root would need a batching rule) and not under a
    forward-mode level (``jvp(grad(f))``, eager ``forward_ad``: it would need a
    ``jvp`` rule). There the outputs stay the roots.
    """
    if keep_graph or _forward_ad_active():
        return False
    return all(i.key() == GRAD for i in interpreters())


def rooted(
    primal: Callable[..., tuple[torch.Tensor, ...]],
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``primal`` with each output that requires grad replaced by its `_Root`."""

    def roots(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(
            _Root.apply(t) if t.requires_grad else t  # type: ignore[no-untyped-call]
            for t in primal(*args)
        )

    return roots
