"""Tensors a region reads without receiving them, in the eager engine: a closure, a
global, a dict entry or an attribute (NOTE [ The eager engine ] rule 1 in
``__init__.py``; the walk is ``_capture/closure.py``).

Such a tensor cannot be recomputed, so it is kept, with its version checked when
unpacked (an in-place write before backward raises, as in autograd), and its
binding checked in the recompute (`FrameState.check_rebound`: a rebinding is not
a write). Module state is the module state guard's (``_capture/module_state.py``).
"""

from __future__ import annotations

import weakref

import torch

from ..._capture.closure import find_closed_over
from ..._replay.modes import detached
from .recompute import RecomputingFrame
from .state import Holder


class OutsideTensors(RecomputingFrame):
    """Finding and keeping what a region read from outside it."""

    #: Saved tensors (no views) no op of the region's graph made, not known yet to
    #: be made outside (regions without an op log): (holder, a weak reference to
    #: the tensor, its version when saved).
    unsure: list[tuple[Holder, weakref.ref[torch.Tensor], int]] | None = None

    def maybe_outside(self, t: torch.Tensor) -> bool:
        """Whether ``t`` may be a tensor the region read without receiving it (see
        `closed_over`): a tensor with a ``grad_fn`` was made by the region's graph."""
        if t.grad_fn is not None:
            return False
        base = t._base
        return base is None or not (base.is_leaf and base.requires_grad)

    def note_unsure(self, t: torch.Tensor, holder: Holder) -> None:
        if self.unsure is None:
            self.unsure = []
        self.unsure.append((holder, weakref.ref(t), t._version))

    def settle_unsure(self) -> None:
        """End of forward: keep the unsure saved tensors made outside the region.

        One that nothing in Python references any more (a non-differentiable
        output of an op, such as layer norm's mean) is held by no closure,
        global or attribute, so the recompute makes it again: no walk for it.
        The others are looked up as `closed_over` does; one found is kept, at
        the version it had when saved (a write since raises when unpacked).
        """
        unsure, self.unsure = self.unsure or [], None
        for holder, ref, version in unsure:
            t = ref()
            if t is None:
                # Referenced from autograd's graph only: an op's own output, or a
                # tensor the forward read and then rebound (`check_unbound`).
                self.unreferenced.add(holder.index)
                continue
            where = self.closed_over(t)
            if where is None:
                continue
            holder.demotable = False
            holder.tensor, holder.version = detached(t), version
            self.note_outside(holder, t, where)

    def closed_over(self, t: torch.Tensor) -> str | None:
        """Where the region found ``t`` (or the tensor ``t`` views) without receiving it.

        Only a tensor no op of the region's graph made (no ``grad_fn``) is
        looked up: what autograd saves with a ``grad_fn`` was made in the region
        (the usual case, and the walk costs a call's worth of Python). Parameters
        and their views are left to `note_leaf` and the state guard, which also
        see a ``.data`` assignment.
        """
        if t.grad_fn is not None:
            return None
        base = t._base
        if base is not None and base.is_leaf and base.requires_grad:
            return None
        if self.outside is None:  # walked once, at the first tensor saved
            bindings = find_closed_over(self.region.fn)
            self.outside = bindings.reached()
            self.outside_module_state = bindings.module_state()
        found = id(t) if id(t) in self.outside or base is None else id(base)
        return self.outside.get(found)

    def note_outside(self, holder: Holder, t: torch.Tensor, where: str) -> None:
        """``t`` was found outside the region at ``where``: keep it, and check in the
        recompute that the binding still gives it (`check_rebound`), unless it is
        module state the module state guard restores."""
        holder.owned = False
        self.outside_names[holder.index] = where
        ids = {id(t)} if t._base is None else {id(t), id(t._base)}
        if not ids & self.outside_module_state:
            self.rebind_checked.add(holder.index)
