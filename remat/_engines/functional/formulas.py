"""Backward formulas that differ by grad mode, and whether a recompute's graph has one.

A few of autograd's backward formulas take another route when grad mode is on
(a backward that builds a graph, ``create_graph=True``): ``silu``, ``mish`` and
``group_norm`` compute an infinitely differentiable form, which rounds otherwise
(torch 2.13: up to 2e-7 in float32, 2e-2 in bfloat16; ``binary_cross_entropy_with_logits``
in bfloat16). ``torch.func.grad`` runs its backward that way, so without remat
a region's gradients come from those forms; the torch.func engine's backward
runs its ``vjp`` without a graph where nothing differentiates it (NOTE [ The
functional engine ] rule 4), which would give the other form's bits. So where
the caller's backward runs under grad mode and the recompute's graph holds one
of these nodes, the backward builds the graph too (and lets it go at once);
elsewhere it keeps the cheaper backward, whose peak memory is the eager engine's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["differ_by_grad_mode"]

#: The autograd nodes whose formula reads grad mode (found by comparing
#: ``create_graph=False`` with ``True`` over the common ops, torch 2.13).
_BY_GRAD_MODE = frozenset({
    "SiluBackward0",
    "MishBackward0",
    "NativeGroupNormBackward0",
    "BinaryCrossEntropyWithLogitsBackward0",
})


def differ_by_grad_mode(nodes: Iterable[Any]) -> bool:
    """Whether the graph behind the autograd ``nodes`` (None: no graph) has a node whose
    formula reads grad mode."""
    stack = [n for n in nodes if n is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ in _BY_GRAD_MODE:
            return True
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return False
