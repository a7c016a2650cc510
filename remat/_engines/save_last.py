"""Which `save_last` regions are the latest: one list per thread, shared by both engines.

NOTE [ The save-last chain ]
1. A region whose policy saves the latest region (``save-last``, ``save-last+P``)
   holds everything it produced while it is *latest*, and only what its base
   policy ``P`` keeps once it is demoted.
2. Each engine registers, at the start of such a region's forward, a handle
   (`Demotable`): the eager engine its `Frame`, the torch.func engine the policy
   its op log records with. The list is one for both engines, so ``save-last``
   means the same in a model whose regions run under different engines.
3. Who demotes whom. An eager region is latest from its forward until a later
   save-last region that reads its outputs (directly, or through any ops in
   between) starts its forward. Reading is read off the autograd graph (rules
   5-6), so "latest" means the latest region of a chain of dependent regions.
   A torch.func-engine region cannot be found that way (under a transform its
   outputs are functorch wrappers, and it registers inside the Function's
   forward, below the graph its inputs came from): it is latest until the next
   save-last region of either engine starts, and it demotes every region before
   it when it starts.
4. Regions on independent data are independent chains in the eager engine, each
   with its own latest region. This is what makes pipeline schedules (GPipe,
   1F1B) well defined: a stage runs several microbatches' forwards before their
   backwards, and each microbatch's last block keeps its activations until that
   microbatch's backward; the first block of the next microbatch does not read
   them, so it does not demote them. In one ordinary forward every region reads
   the one before it, which gives the plain rule: only the most recent is latest.
5. Marks: when an eager latest region's forward ends, a weak reference to its
   frame goes into the ``metadata`` of each of its outputs' ``grad_fn`` nodes. A
   new region walks the graph back from its inputs' ``grad_fn`` nodes and stops
   at marked nodes, at leaves and at nodes it has seen: it walks only the ops
   between it and the regions before it, and nothing at all while none is latest.
6. A demoted region's marks stay (its outputs still stop the walk) but demote
   nothing: a region reading only a demoted region's outputs starts a branch of
   its own, and the branch the demoted region fed keeps its latest region.
7. Everything is weak: a frame lives as long as autograd's saved variables
   (through its holders); the marks live on graph nodes and die with them. A
   region whose backward has run (or whose graph was dropped) leaves nothing.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch

from .._state import local

__all__ = ["Demotable", "become_latest", "mark_outputs", "separate_list"]

#: The key of a latest region's mark in a ``grad_fn`` node's ``metadata``.
_MARK = "remat.save_last"


class Demotable(Protocol):
    """What a save-last region registers: it can stop holding what only being latest kept."""

    def demote(self) -> None: ...


def become_latest(handle: Demotable, inputs: Iterable[torch.Tensor] | None = None) -> None:
    """Register ``handle`` as latest, demoting the regions it follows (NOTE rule 3).

    ``inputs`` are an eager region's inputs (the graph walk starts there);
    ``None`` (the torch.func engine) demotes every region registered before.
    """
    alive = [ref for ref in local.last_regions if ref() is not None]
    read = _marked_ancestors(inputs) if inputs is not None and alive else None
    keep = []
    for ref in alive:
        previous = ref()
        if previous is None or previous is handle:
            continue
        if read is None or not _graph_visible(previous) or any(previous is f for f in read):
            previous.demote()
        else:
            keep.append(ref)
    keep.append(weakref.ref(handle))
    local.last_regions = keep


def mark_outputs(frame: Demotable, outputs: Iterable[Any]) -> None:
    """Mark the graph nodes of an eager ``frame``'s outputs (NOTE rule 5 above)."""
    ref = weakref.ref(frame)
    _VISIBLE.add(frame)
    for out in outputs:
        node = out.grad_fn if isinstance(out, torch.Tensor) else None
        if node is not None:
            _metadata(node).setdefault(_MARK, []).append(ref)


#: Handles whose outputs carry marks: the graph walk can find them (rule 3).
_VISIBLE: weakref.WeakSet[Any] = weakref.WeakSet()


def _graph_visible(handle: Demotable) -> bool:
    return handle in _VISIBLE


def _marked_ancestors(inputs: Iterable[torch.Tensor]) -> list[Demotable]:
    """The frames whose marked nodes the graph behind ``inputs`` reaches."""
    stack: list[Any] = [t.grad_fn for t in inputs if t.grad_fn is not None]
    seen: set[int] = set()
    found: list[Demotable] = []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        marks = _metadata(node).get(_MARK)
        if marks is not None:
            found.extend(frame for frame in (ref() for ref in marks) if frame is not None)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _metadata(node: Any) -> dict[str, Any]:
    # A property on every graph node; torch's stub types it as a method.
    metadata: dict[str, Any] = node.metadata
    return metadata


@contextlib.contextmanager
def separate_list() -> Iterator[None]:
    """Run the body with a save-last list of its own on this thread (an inspection's).

    The regions it runs neither demote nor are demoted by those around it; the
    thread's list is as it was afterwards.
    """
    previous, local.last_regions = local.last_regions, []
    try:
        yield
    finally:
        local.last_regions = previous
