"""Which `save_last` regions are last: one per chain of dependent regions (eager engine).

NOTE [ The last region of a chain ]
1. A `save_last` region is *last* from its forward until a later `save_last`
   region that reads its outputs (directly, or through any ops in between)
   starts its forward: that region demotes it. Reading is read off the autograd
   graph, so "last" means the last region of a chain of dependent regions.
2. Regions on independent data are independent chains, each with its own last
   region. This is what makes pipeline schedules (GPipe, 1F1B) well defined: a
   stage runs several microbatches' forwards before their backwards, and each
   microbatch's last block keeps its activations until that microbatch's
   backward; the first block of the next microbatch does not read them, so it
   does not demote them. In one ordinary forward every region reads the one
   before it, which gives the old rule: only the most recent region is last.
3. Marks: when a last region's forward ends, a weak reference to its frame goes
   into the ``metadata`` of each of its outputs' ``grad_fn`` nodes. A new
   region walks the graph back from its inputs' ``grad_fn`` nodes and stops at
   marked nodes, at leaves and at nodes it has seen: it walks only the ops
   between it and the regions before it (and the unmarked graph before the
   first one), and nothing at all while no region is last.
4. A demoted region's marks stay (its outputs still stop the walk), but demote
   nothing: a region reading only a demoted region's outputs starts a branch of
   its own, and the branch the demoted region fed keeps its last region.
5. Everything is weak: a frame lives as long as autograd's saved variables
   (through its holders); the marks live on graph nodes and die with them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from .._state import local

__all__ = ["Demotable", "mark_outputs", "start_last"]

#: The key of a last region's mark in a ``grad_fn`` node's ``metadata``.
_MARK = "remat.save_last"


class Demotable(Protocol):
    """A region's frame as this module sees it."""

    def demote(self) -> None: ...


def start_last(frame: Demotable, inputs: Iterable[torch.Tensor]) -> None:
    """Demote the last regions ``inputs`` depend on; ``frame`` becomes a last region."""
    alive = [ref for ref in local.last_regions if ref() is not None]
    if alive:
        read = _marked_ancestors(inputs)
        keep = []
        for ref in alive:
            previous = ref()
            if previous is not None and any(previous is f for f in read) and previous is not frame:
                previous.demote()
            else:
                keep.append(ref)
        alive = keep
    alive.append(weakref.ref(frame))
    local.last_regions = alive


def mark_outputs(frame: Demotable, outputs: Iterable[Any]) -> None:
    """Mark the graph nodes of ``frame``'s outputs (NOTE rule 3)."""
    ref = weakref.ref(frame)
    for out in outputs:
        node = out.grad_fn if isinstance(out, torch.Tensor) else None
        if node is not None:
            _metadata(node).setdefault(_MARK, []).append(ref)


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
