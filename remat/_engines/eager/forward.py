"""The forward phase: ``fn`` runs under saved-tensor hooks, and pack decides per saved
tensor (NOTE [ The eager engine ] rule 1 in ``__init__.py``)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch

from ..._compat import current_autograd_node, no_dispatch_modes
from ..._compile import runs_plainly, uncompiled
from ..._errors import RematError
from ..._policy.base import Decision
from ..._replay.modes import RecordMode, detached
from ..._replay.saved_signatures import saved_signature
from .argument_nodes import argument_nodes_watched
from .bindings import forward_reads
from .outside import OutsideTensors
from .state import (
    _HOOKS_REFUSED,
    Holder,
    Phase,
    TorchFuncInsideError,
    _pushed,
    _rewind,
    _version,
)


class Frame(OutsideTensors):
    """One call of one region: its inputs, its holders, and how to recompute them."""

    def run_forward(self) -> Any:
        start_versions = [_version(t) for t in self.inputs]
        self.versions = start_versions
        failure: RuntimeError | None = None
        with contextlib.ExitStack() as stack:
            stack.enter_context(_pushed(self))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
            if self.log is not None:
                stack.enter_context(RecordMode(self.log))
            reads = forward_reads(self.bound)
            if reads is not None:  # NOTE [ Bindings the recompute reads ] rule 8
                stack.enter_context(reads)
            stack.enter_context(self.state_guard.guarded())
            stack.enter_context(argument_nodes_watched(self, self.inputs))
            try:
                out = self.region.fn(*self.args, **self.kwargs)
            except RuntimeError as error:
                if _HOOKS_REFUSED not in str(error) or isinstance(error, RematError):
                    raise
                failure = error
        if failure is not None:
            raise self.torch_func_inside() from failure
        if reads is not None and self.bound is not None:
            self.bound.settle(reads.seen)
        self.versions = [_version(t) for t in self.inputs]
        self.mutated_in_forward = self.versions != start_versions
        self.rng_after = self.rng.now() if self.rng is not None else None
        self.phase = Phase.DONE
        self.settle_unsure()
        self.finish_forward(out)
        return out

    def torch_func_inside(self) -> TorchFuncInsideError:
        """``fn`` started a torch.func transform, which refuses saved-tensor hooks.

        The transform refuses at its start, so ``fn`` can run again under the
        torch.func engine if what ran before it changed nothing remat cannot put
        back: the random generators are rewound; an input written in place, or a
        stateful module's buffers (BatchNorm statistics), make it unclean.
        """
        clean = [_version(t) for t in self.inputs] == self.versions
        seen = getattr(self.state_guard, "seen", None) or ()
        with no_dispatch_modes(), torch.no_grad():
            if any(not torch.equal(table[name], copy) for table, name, copy in seen):
                clean = False
        if self.rng is not None:
            _rewind(self.rng)
        what = (
            f"remat: {self.region.label} calls a torch.func transform (grad, vjp, jacrev, "
            "hessian, ...) inside, where the eager engine's saved-tensor hooks cannot run"
        )
        if not clean:
            message = (
                f"{what}, and before it the function modified an input in place or a "
                "module's buffers (BatchNorm statistics), which running it again under "
                "the torch.func engine would modify twice. Make the part that calls the "
                "transform a region of its own, with those changes outside it."
            )
        elif self.region.engine == "eager":
            message = (
                f"{what}. Use engine='functional' (or 'auto', the default, which switches "
                "by itself): it runs the region as an autograd.Function, which works under "
                "loss.backward() too."
            )
        else:
            message = f"{what}."  # "auto" switches engines: never shown
        return TorchFuncInsideError(message, clean=clean)

    def pack(self, t: torch.Tensor) -> Holder:
        # A compiled module run inside the region: Dynamo must not trace our hooks.
        if runs_plainly():
            return self._pack(t)
        return uncompiled(self._pack, t)

    def _pack(self, t: torch.Tensor) -> Holder:
        holder = Holder(self, len(self.holders))
        self.holders.append(weakref.ref(holder))
        if not self.inner_backward and current_autograd_node() is not None:
            self.inner_backward = True
        if t._base is not None:  # (tested here: a call per saved tensor saved)
            self.note_leaf(t)
        if self.check:
            self.metas.append(saved_signature(t, id(t) in self.input_ids))
        if self.log is not None:
            holder.clock = len(self.log.records)
        decision = self.decision_for(t, holder)
        if decision is Decision.OFFLOAD:
            holder.tensor = self.offload_saved(t, holder)
            holder.version = t._version  # checked only if it stayed a tensor on device
        elif decision is not Decision.RECOMPUTE:
            holder.tensor = detached(t)
            holder.version = t._version
        if self.parent is not None:
            self.parent.collect(holder, t)
        return holder

    def note_leaf(self, t: torch.Tensor) -> None:
        """Remember the version of a parameter that ``t`` views (``W.t()``).

        The view is recomputed from the parameter wherever the region found it (a
        global, an attribute), so an in-place change before backward must raise,
        as autograd raises for the tensors it saves. (A parameter saved itself is
        kept, with its version checked when unpacked.)
        """
        base = t._base
        if base is None:
            return
        if base.is_leaf and base.requires_grad and id(base) not in self.leaf_versions:
            self.leaf_versions[id(base)] = (base, base._version)

    def decision_for(self, t: torch.Tensor, holder: Holder) -> Decision:
        """What happens to saved tensor ``t``: the policy's decision (`Policy.decide`)
        for the op output it is, or ``SAVE`` where recomputing it is not possible."""
        if id(t) in self.input_ids or (t.is_leaf and t.requires_grad):
            holder.owned = False
            return Decision.SAVE  # alive anyway: keeping a reference costs nothing
        if self.log is not None:
            holder.source = self.log.lookup(t)
            if holder.source is None:
                holder.owned = False
                where = self.closed_over(t)
                if where is not None:
                    self.note_outside(holder, t, where)
                return Decision.SAVE  # made outside the region: a closure or a global
            record, position = holder.source
            decision = record.decision_at(position)
        else:
            # Made outside the region (a closure, a global, an attribute), ``t`` must be
            # kept, so an in-place change before backward raises as in plain autograd
            # instead of a recompute from the new values. Finding out walks all the
            # function reaches: for a tensor that is no view, only at the end of the
            # forward, and only if Python still references it then (`settle_unsure`).
            if t.grad_fn is None and self.maybe_outside(t):  # (a call fewer per saved tensor)
                if t._base is None:
                    self.note_unsure(t, holder)
                elif (where := self.closed_over(t)) is not None:
                    self.note_outside(holder, t, where)
                    return Decision.SAVE
            assert self.decision is not None, "this is a bug in remat, please report it"
            decision = self.decision
        if decision is Decision.OFFLOAD and not self.can_offload(t):
            decision = Decision.SAVE
        if self.holds_all_as_latest and decision is Decision.RECOMPUTE:
            holder.demotable = True
            return Decision.SAVE
        return decision
