"""Whether a backward inside a region's forward ran through an argument's graph.

A region may call ``torch.autograd.grad(e, x0)`` with respect to a tensor that
reaches it both directly and through a non-leaf argument (``p = x0 * 2`` computed
outside). The forward's backward follows both paths; the recompute, on detached
arguments, only the direct one: its ``g`` differs, and the gradient is silently
wrong (NOTE in ``_engines/autograd_inside.py``). The recompute catches such a
call with a `GradWatch`, paid only by regions whose forward ran a backward
(`Frame.inner_backward`). A backward with ``create_graph=True`` shows itself by
packing tensors while a node runs; one without packs nothing, so the forward
also puts a pre hook on each argument's ``grad_fn``: an inner backward that runs
one of those nodes ran through an argument computed outside the region.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

__all__ = ["argument_nodes_watched"]


class _RunsBackwards(Protocol):
    inner_backward: bool


@contextlib.contextmanager
def argument_nodes_watched(frame: _RunsBackwards, inputs: Sequence[torch.Tensor]) -> Iterator[None]:
    """Set ``frame.inner_backward`` if a backward runs an argument's node meanwhile."""
    nodes = {id(t.grad_fn): t.grad_fn for t in inputs if t.grad_fn is not None}
    if not nodes:
        yield
        return
    ref = weakref.ref(frame)

    def ran(grad_outputs: Any) -> None:
        noticed = ref()
        if noticed is not None:
            noticed.inner_backward = True

    handles = [node.register_prehook(ran) for node in nodes.values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
