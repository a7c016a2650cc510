"""The eager engine: a region's policy applied through saved-tensor hooks.

NOTE [ The eager engine ]
1. Forward: ``fn`` runs with grad enabled under `saved_tensors_hooks` (and a
   `RecordMode` when the policy looks at ops or names). Every tensor autograd
   saves goes through `Frame.pack`, which returns a `Holder`: it holds the
   tensor when the policy keeps it (region inputs and parameters are always
   kept: they are alive anyway), and nothing when the policy drops it.
2. Backward: the first `Frame.unpack` of an empty holder recomputes the region
   once: ``fn`` runs again on detached inputs, with the forward's RNG and
   autocast state, under a `ReplayMode` (kept op outputs are returned instead of
   recomputed) and under hooks that put the k-th saved tensor into the k-th
   holder. It stops (`_StopRecompute`) as soon as the last empty holder is full.
3. The frame holds weak references to its holders: a holder dies with autograd's
   saved variable, so whatever backward has consumed is freed at once.
4. Nesting (the outer policy wins): a region called during another region's
   forward runs its function plainly, inside the outer region. A region called
   during another region's *recompute* runs as a region of its own; it hands
   each of its holders to the outer recompute in place of a tensor, so the outer
   backward unpacks through the inner region's policy (two-level recompute).
5. `save_last`: a region whose policy keeps the last region holds everything it
   produced, marked demotable; when a later such region that reads its outputs
   starts its forward, it is demoted: demotable holders are emptied and
   recompute armed (NOTE [ The last region of a chain ] in ``last_regions.py``:
   regions on independent data, such as pipeline microbatches, each keep theirs).
6. Offload (NOTE [ Offload: streams, events, prefetch ] in ``_offload/store.py``): an
   ``OFFLOAD`` value goes to the frame's host store once, as an `Offloaded`
   entry keyed by the op output it is (record, position). A saved tensor is put
   in `pack`, right after its op. (Writing to a saved tensor later is an error
   in plain autograd; under saved-tensor hooks autograd no longer detects it,
   and on CUDA such a write would race with the copy.) A kept op output that
   autograd does not save (the recompute replays it) is put at the end of the
   forward, after checking that nothing wrote to it. Entries are ordered by
   (frame serial, op index, position), so prefetch follows op order either way.
   The holder keeps the entry; the record keeps a ``meta`` placeholder (so
   liveness still sees a replayable op) and drops the device tensor. The
   recompute fetches values back into the records before replaying (newest
   first, the order prefetch expects) and drops them after. Kept on the device
   instead: what the store does not accept (CPU tensors under the CUDA store,
   small or strided tensors), region inputs, parameters and their views, region
   outputs (alive anyway), values mutated after they were kept, and everything
   produced during another region's recompute (needed again at once).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._capture.closure import find_closed_over
from .._capture.module_state import state_guard_of
from .._compat import current_autograd_node, no_dispatch_modes
from .._compile import uncompiled
from .._errors import NondeterministicRecomputeError, RematError, SavedInputMutatedError
from .._offload.selection import current_store
from .._offload.store import HostStore, Offloaded, next_serial, offload, placeholder_for
from .._policy.base import Decision
from .._policy.name_check import check_names
from .._pytree import check_outputs_visible, flatten, flatten_region_io, tensor_leaves, tree_map
from .._replay.autocast import AutocastState
from .._replay.checks import (
    CURES,
    SavedSignature,
    describe_saved,
    divergence,
    same_signature,
    saved_signature,
)
from .._replay.modes import RecordMode, ReplayMode, side_by_side
from .._replay.records import OpLog, OpRecord
from .._replay.rng import RngState, check_batched_recompute, generators_of
from .._replay.tags import tag_of
from .._state import local, recomputing
from .autograd_inside import GradWatch, OutsideGradError, feeds
from .budget_plans import log_policy, settle
from .last_regions import mark_outputs, start_last
from .region import Region

__all__ = ["Frame", "Holder", "TorchFuncInsideError", "run_eager"]


#: What torch says when a torch.func transform starts under saved-tensor hooks.
_HOOKS_REFUSED = "don't yet support saved tensor hooks"


class TorchFuncInsideError(RematError):
    """A region's function calls a torch.func transform, which the eager engine cannot run.

    ``clean``: nothing ran before the transform that a second run would change
    (the "auto" engine choice then runs the region under the torch.func engine).
    """

    def __init__(self, message: str, clean: bool) -> None:
        super().__init__(message)
        self.clean = clean


class _StopRecompute(BaseException):
    """Raised inside a recompute once every tensor backward needs has been collected.

    A `BaseException`, like `GeneratorExit`: a user's ``except Exception`` inside
    the region (a fallback path) must not swallow it and run other ops.
    """


class Holder:
    """What autograd keeps for one saved tensor of a region."""

    __slots__ = (
        "__weakref__", "clock", "demotable", "frame", "index", "owned", "source", "tensor",
        "version",
    )

    def __init__(self, frame: Frame, index: int) -> None:
        self.frame = frame
        self.index = index
        #: The saved tensor, an inner region's holder (rule 4), an offloaded
        #: entry (rule 6), or None when dropped.
        self.tensor: torch.Tensor | Holder | Offloaded | None = None
        #: The record and output position of the op that produced the tensor.
        self.source: tuple[OpRecord, int] | None = None
        #: Ops recorded before this tensor was saved (the recompute must run that far).
        self.clock = 0
        self.demotable = False
        #: Version of the kept tensor when it was saved (a mismatch: written in place since).
        self.version = 0
        #: Whether the region made the tensor (so a recompute can make it again).
        self.owned = True


class Frame:
    """One call of one region: its inputs, its holders, and how to recompute them."""

    def __init__(self, region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.region = region
        self.args = args
        self.kwargs = kwargs
        leaves, _ = flatten((args, kwargs))
        self.inputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self.input_ids = {id(t) for t in self.inputs}
        policy = region.policy
        self.log = (
            OpLog(log_policy(region, self.inputs, "eager"), region.label)
            if policy.needs_op_trace or region.debug
            else None
        )
        self.decision = None if policy.needs_op_trace else policy.decision_without_ops()
        self.keep_all = policy.keeps_last_region
        self.holders: list[weakref.ref[Holder]] = []
        self.check = region.determinism_check
        #: The signature of each saved tensor, kept only for the determinism check
        #: (NOTE [ Recompute signatures ] in ``_replay/checks.py``).
        self.metas: list[SavedSignature] = []
        #: Ids of the recompute's (detached) inputs, to sign its saved tensors.
        self.recompute_input_ids: set[int] = set()
        self.rng = (
            RngState.capture(self.inputs, generators_of(region.fn, leaves))
            if region.preserve_rng_state
            else None
        )
        #: The generators' states when the forward ended: did it draw random numbers?
        self.rng_after: RngState | None = None
        self.autocast = AutocastState.capture()
        self.state_guard = state_guard_of(region.fn, leaves, region.label)
        self.versions: list[int] = []
        #: Tensors the region reads without receiving them (closures, globals,
        #: attributes), by id, with where they were found; None until needed.
        self.outside: dict[int, str] | None = None
        #: Saved holders of such tensors, by index: where the tensor was found.
        self.outside_names: dict[int, str] = {}
        #: Parameters (leaves requiring grad) the forward saved views of.
        self.leaf_versions: dict[int, tuple[torch.Tensor, int]] = {}
        self.mutated_in_forward = False
        #: Whether autograd ran a backward while the forward saved tensors
        #: (``torch.autograd.grad`` inside ``fn``): the recompute then watches it.
        self.inner_backward = False
        #: The frame whose recompute is running this region (rule 4), if any.
        self.parent: Frame | None = None
        self.phase = "forward"
        self.recompute_counter: Any = None
        self.needed: dict[int, Holder] = {}
        self.stop_at = -1
        self.store: HostStore = current_store(region.offload_store)
        self.serial = next_serial()  # orders this frame's offloads after earlier frames'
        #: Offloaded op outputs by (id(record), position): (record, op index, entry).
        self.offloaded: dict[tuple[int, int], tuple[OpRecord, int, Offloaded]] = {}
        #: The version each offloaded output had when its copy was made.
        self.offloaded_versions: dict[tuple[int, int], int] = {}

    # -- forward -------------------------------------------------------------

    def run_forward(self) -> Any:
        start_versions = [_version(t) for t in self.inputs]
        self.versions = start_versions
        failure: RuntimeError | None = None
        with contextlib.ExitStack() as stack:
            stack.enter_context(_pushed(self))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
            if self.log is not None:
                stack.enter_context(RecordMode(self.log))
            stack.enter_context(self.state_guard.guarded())
            try:
                out = self.region.fn(*self.args, **self.kwargs)
            except RuntimeError as error:
                if _HOOKS_REFUSED not in str(error) or isinstance(error, RematError):
                    raise
                failure = error
        if failure is not None:
            raise self.torch_func_inside() from failure
        self.versions = [_version(t) for t in self.inputs]
        self.mutated_in_forward = self.versions != start_versions
        self.rng_after = self.rng.now() if self.rng is not None else None
        self.phase = "done"
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
        return uncompiled(self._pack, t)

    def _pack(self, t: torch.Tensor) -> Holder:
        holder = Holder(self, len(self.holders))
        self.holders.append(weakref.ref(holder))
        if not self.inner_backward and current_autograd_node() is not None:
            self.inner_backward = True
        self.note_leaf(t)
        if self.check:
            self.metas.append(saved_signature(t, id(t) in self.input_ids))
        if self.log is not None:
            holder.clock = len(self.log.records)
        decision = self.decide(t, holder)
        if decision is Decision.OFFLOAD:
            holder.tensor = self.offload_saved(t, holder)
            holder.version = t._version  # checked only if it stayed a tensor on device
        elif decision is not Decision.RECOMPUTE:
            holder.tensor = t.detach()
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

    def decide(self, t: torch.Tensor, holder: Holder) -> Decision:
        if id(t) in self.input_ids or (t.is_leaf and t.requires_grad):
            holder.owned = False
            return Decision.SAVE  # alive anyway: keeping a reference costs nothing
        if self.log is not None:
            holder.source = self.log.lookup(t)
            if holder.source is None:
                holder.owned = False
                where = self.closed_over(t)
                if where is not None:
                    self.outside_names[holder.index] = where
                return Decision.SAVE  # made outside the region: a closure or a global
            record, position = holder.source
            decision = record.decision_at(position)
        else:
            where = self.closed_over(t)
            if where is not None:
                # Made outside the region (no op log says so here): keep it, so an
                # in-place change before backward raises as plain autograd does,
                # instead of a recompute from the new values.
                holder.owned = False
                self.outside_names[holder.index] = where
                return Decision.SAVE
            assert self.decision is not None, "this is a bug in remat, please report it"
            decision = self.decision
        if decision is Decision.OFFLOAD and not self.can_offload(t):
            decision = Decision.SAVE
        if self.keep_all and decision is Decision.RECOMPUTE:
            holder.demotable = True
            return Decision.SAVE
        return decision

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
            self.outside = find_closed_over(self.region.fn).reached()
        where = self.outside.get(id(t))
        if where is None and base is not None:
            where = self.outside.get(id(base))
        return where

    def finish_forward(self, out: Any = None) -> None:
        """Fill holders named after they were saved; release kept ops nothing reads."""
        if self.log is None:
            return
        self.settle_budget()
        self.log.end_forward()
        check_names(self.log.policy, self.region.label, self.log.names_seen)
        # Only outputs something will read are worth a copy to the host.
        self.offload_kept(out, None if self.keep_all else self.liveness())
        for holder in self.alive():
            if holder.tensor is not None and self.named_to_recompute(holder):
                # Saved by its own op (``exp`` saves its result) before
                # `checkpoint_name` gave it a name the policy recomputes: the
                # name overrides the op's decision here too.
                if self.keep_all:
                    holder.demotable = True
                else:
                    holder.tensor = None
            elif holder.tensor is None and holder.source is not None:
                record, position = holder.source
                if (id(record), position) in self.offloaded:
                    holder.tensor = self.offloaded[id(record), position][2]
                elif (kept := record.kept_at(position)) is not None:
                    holder.tensor = kept
                    holder.version = record.kept_version(position)
        if not self.keep_all:
            self.release_unread()
            self.prune_offloaded()

    def settle_budget(self) -> None:
        """A memory budget's first call plans here; drop what the plan does not keep.

        NOTE [ Budget plans ] in ``budget_plans.py``: the plan reads which op
        outputs autograd saved, and when (the holders' clocks).
        """
        assert self.log is not None, "this is a bug in remat, please report it"
        alive = self.alive()
        saved = [
            (h.source[0].index, h.source[1], h.clock) for h in alive if h.owned and h.source
        ]
        outside = [h.tensor for h in alive if not h.owned and isinstance(h.tensor, torch.Tensor)]
        dropped = settle(self.log, saved, [*self.inputs, *outside])
        if dropped:
            for holder in alive:
                if holder.owned and holder.source and holder.source[0].index in dropped:
                    holder.tensor = None

    def named_to_recompute(self, holder: Holder) -> bool:
        """Whether a name given after ``holder`` was packed makes the policy recompute it."""
        if holder.source is None or not holder.owned or holder.demotable:
            return False
        record, position = holder.source
        named = record.named.get(position) if record.named is not None else None
        return named is not None and named[1] is Decision.RECOMPUTE

    # -- offload (NOTE rule 6) -------------------------------------------------

    def can_offload(self, t: torch.Tensor) -> bool:
        if self.parent is not None or self.log is None or not self.store.accepts(t):
            return False
        base = t._base
        # A view of a parameter or an input frees nothing when copied away.
        return base is None or not (
            id(base) in self.input_ids or (base.is_leaf and base.requires_grad)
        )

    def offload_saved(self, t: torch.Tensor, holder: Holder) -> Offloaded | torch.Tensor:
        """Pack: put ``t`` (once per op output) and drop the record's device copy."""
        assert holder.source is not None, "this is a bug in remat, please report it"
        record, position = holder.source
        entry = self._offload_output(record, record.index, position, t)
        return entry if entry is not None else t.detach()

    def _offload_output(
        self, record: OpRecord, index: int, position: int, t: torch.Tensor
    ) -> Offloaded | None:
        key = (id(record), position)
        if key in self.offloaded:
            if self.offloaded_versions[key] != t._version:
                return None  # written since its copy was made: this save keeps it on device
            return self.offloaded[key][2]  # the same value saved twice: one copy
        if record.version_moved(position, t):
            # Written since the op made it: the replay would write it again on top
            # of a copy of the written value. Kept on device instead.
            return None
        with no_dispatch_modes():  # the copies are ours, not the region's ops
            entry = offload(t.detach(), self.store, (self.serial, index, position))
            placeholder = placeholder_for(t)
        if entry is None:
            return None
        self.offloaded[key] = (record, index, entry)
        self.offloaded_versions[key] = t._version
        if record.holds_outputs():
            record.mark_offloaded(position, placeholder)
        return entry

    def offload_kept(self, out: Any, live: list[bool] | None) -> None:
        """End of forward: put kept ``OFFLOAD`` outputs that no holder took yet.

        With ``live`` (the recompute's liveness), outputs of dead ops are left to
        be released instead.
        """
        assert self.log is not None, "this is a bug in remat, please report it"
        outputs = {tag_of(t) for t in tensor_leaves(out)}
        for index, record in enumerate(self.log.records):
            if live is not None and not live[index]:
                continue
            for position, t in record.unwritten_outputs():
                if (
                    (id(record), position) not in self.offloaded
                    and record.decision_at(position) is Decision.OFFLOAD
                    and (self.log.serial, index, position) not in outputs
                    and self.can_offload(t)
                ):
                    self._offload_output(record, index, position, t)

    def restore_offloaded(self, clock: int) -> list[tuple[OpRecord, int]]:
        """Recompute: fetch offloaded outputs of ops before ``clock`` back into the records."""
        restored = []
        entries = sorted(self.offloaded.items(), key=lambda item: item[1][2].seq, reverse=True)
        for (_, position), (record, index, entry) in entries:
            if index < clock and record.holds_outputs():
                # The forward wrote to this output after its copy was made, so the
                # replay writes to it again: give it its own copy, the entry's
                # cached value stays what the holders saved.
                written = record.written_after_kept(position)
                with no_dispatch_modes():
                    value = entry.get().clone() if written else entry.get()
                record.restore(position, value)
                restored.append((record, position))
        return restored

    def prune_offloaded(self) -> None:
        """Forget entries of released records (holders keep theirs alive)."""
        for key, (record, _, _) in list(self.offloaded.items()):
            if not record.holds_outputs():
                del self.offloaded[key]
                del self.offloaded_versions[key]

    def release_unread(self) -> None:
        # A kept output that no live op of the recompute reads is never replayed
        # (holders reference what backward itself reads): let it go.
        assert self.log is not None, "this is a bug in remat, please report it"
        live = self.liveness()
        for record, is_live in zip(self.log.records, live, strict=True):
            if not is_live:
                record.release()

    def liveness(self, alive: list[Holder] | None = None) -> list[bool]:
        assert self.log is not None, "this is a bug in remat, please report it"
        if alive is None:
            alive = self.alive()
        needed = [h.source[0].index for h in alive if h.tensor is None and h.source]
        live = self.log.liveness(needed)
        clock = max((h.clock for h in alive if h.tensor is None), default=0)
        return [is_live and i < clock for i, is_live in enumerate(live)]

    def demote(self) -> None:
        """Stop being the last `save_last` region: drop what only that status kept."""
        self.keep_all = False
        for holder in self.alive():
            if holder.demotable:
                holder.tensor = None
                holder.demotable = False
        if self.log is not None:
            self.release_unread()
            self.prune_offloaded()

    # -- backward ------------------------------------------------------------

    def unpack(self, holder: Holder) -> torch.Tensor:
        # A ``loss.backward()`` inside compiled code runs this hook where Dynamo
        # would compile the recompute (see ``_compile.py``).
        return uncompiled(self._unpack, holder)

    def _unpack(self, holder: Holder) -> torch.Tensor:
        if isinstance(holder.tensor, torch.Tensor) and holder.tensor._version != holder.version:
            self.written_since_saved(holder)
        if holder.tensor is None:
            self.recompute()
        value = holder.tensor
        if isinstance(value, Holder):
            return value.frame.unpack(value)
        if isinstance(value, Offloaded):
            with no_dispatch_modes():
                return value.get()
        if value is None:
            raise RematError(
                f"remat: the recompute of {self.region.label} did not produce saved tensor "
                f"#{holder.index}. This is a bug in remat, please report it."
            )
        return value

    def written_since_saved(self, holder: Holder) -> None:
        """A kept tensor was modified in place after it was saved.

        Plain autograd raises here; saved-tensor hooks switch its check off, so
        the check is ours. A tensor the region made is recomputed as it was; a
        region input or a parameter cannot be, so that raises as autograd does.
        """
        if holder.owned:
            holder.tensor = None
            return
        assert isinstance(holder.tensor, torch.Tensor), "this is a bug in remat, please report it"
        what = self.outside_names.get(
            holder.index, "an input, a parameter or a closed-over tensor"
        )
        raise SavedInputMutatedError(
            "remat: one of the variables needed for gradient computation has been modified "
            f"by an inplace operation: a tensor of shape {tuple(holder.tensor.shape)} that "
            f"{self.region.label} saved ({what}) is "
            f"at version {holder.tensor._version}; expected version {holder.version}. "
            "Modify it after backward, or clone it before modifying it."
        )

    def recompute(self) -> None:
        alive = self.alive()
        self.needed = {h.index: h for h in alive if h.tensor is None}
        if not self.needed:
            return
        self.check_inputs()
        # Eager regions run outside every transform: any vmap now is new.
        check_batched_recompute(self.rng, self.rng_after, frozenset(), self.region.label)
        self.stop_at = max(self.needed)
        restored = self.restore_offloaded(max(h.clock for h in self.needed.values()))
        live = self.liveness(alive) if self.log is not None else None
        replay = self._replay(live)
        # Backward inside the region's own forward (``torch.autograd.grad`` in
        # ``fn``): the recording mode must not see the recompute's ops.
        in_forward = self.phase == "forward"
        try:
            with no_dispatch_modes() if in_forward else contextlib.nullcontext():
                try:
                    with self.grad_watch():
                        self._recompute_or_retry(replay, live)
                except RuntimeError:
                    self.explain_outside_grad()
                    raise
                if any(h.tensor is None for h in self.needed.values()):
                    self.explain_outside_grad()
        finally:
            self.phase = "forward" if in_forward else "done"
            for record, position in restored:
                record.drop(position)  # the collected holders keep what they need
            self.offloaded.clear()
            self.offloaded_versions.clear()
        missing = [i for i, h in self.needed.items() if h.tensor is None]
        # Holders point back at the frame: keeping them would be a cycle that
        # holds every recomputed tensor until the garbage collector runs.
        self.needed = {}
        if missing:
            raise NondeterministicRecomputeError(
                f"remat: the recompute of {self.region.label} differs from its forward: it "
                f"saved {next(self.recompute_counter)} tensors, the forward "
                f"{len(self.holders)}: it ran different ops the second time. Its gradients "
                f"would be wrong. {CURES}" + self._logs(replay)
            )

    def grad_watch(self) -> contextlib.AbstractContextManager[Any]:
        """A `GradWatch` for a recompute whose forward ran a backward, else nothing.

        A tensor reaching ``fn`` both directly and through a non-leaf argument
        would get, in the recompute, a gradient without the second path: wrong,
        and silent. Only regions whose forward ran a backward pay for the watch.
        """
        outer = [t for t in self.inputs if t.grad_fn is not None]
        if not self.inner_backward or not outer:
            return contextlib.nullcontext()
        return GradWatch(self.region.label, lambda t: feeds(t, outer))

    def explain_outside_grad(self) -> None:
        """The recompute failed: raise `OutsideGradError` if that is why.

        ``fn`` may call ``torch.autograd.grad`` with respect to a tensor that
        reaches it only through a non-leaf argument (NOTE in ``_engines/autograd_inside.py``):
        the forward saw that path, the recompute (on detached arguments) cannot.
        Run again, watching those calls, only on this failure path: the watch is
        a mode that would cost every recompute a Python call per op.
        """
        outer = [t for t in self.inputs if t.grad_fn is not None]
        if not outer:
            return
        watch = GradWatch(self.region.label, lambda t: feeds(t, outer))
        try:
            with watch:
                self._run_recompute(self._replay(None))
        except OutsideGradError:
            raise
        except Exception:  # another failure: the caller raises the original
            return

    def _recompute_or_retry(self, replay: ReplayMode | None, live: list[bool] | None) -> None:
        try:
            self._run_recompute(replay)
        except NondeterministicRecomputeError:
            if live is None or all(live):
                raise
            # A replayed op fed only by dead ops: a composite op above it chose
            # another kernel for the meta stand-ins (attention falls back to its
            # math path on meta): run every op this time.
            self._run_recompute(self._replay(None))
        except RematError:
            raise
        except Exception:
            if live is None or all(live):
                raise
            # A dead op's stand-in reached Python (``tolist()``, state kept on an
            # object): run every op this time (NOTE [ Record and replay ] rule 5).
            self._run_recompute(self._replay(None))

    def _replay(self, live: list[bool] | None) -> ReplayMode | None:
        if self.log is None:
            return None
        return ReplayMode(self.log, self.region.determinism_check, live)

    def _run_recompute(self, replay: ReplayMode | None) -> None:
        self.recompute_counter = itertools.count()
        try:
            args, kwargs = _detached(self.args), _detached(self.kwargs)
            self.recompute_input_ids = {id(t) for t in tensor_leaves((args, kwargs))}
            with self._recompute_context(replay):
                self.region.fn(*args, **kwargs)
        except _StopRecompute:
            return  # every holder the backward needs is full (NOTE rule 2)

    def _recompute_context(self, replay: ReplayMode | None) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        try:
            self._enter_recompute(stack, replay)
        except BaseException:
            # Entering can raise (the state guard's in-place check): unwind what was
            # entered, or this thread's frame stack would keep the recompute's frame.
            stack.close()
            raise
        return stack

    def _enter_recompute(self, stack: contextlib.ExitStack, replay: ReplayMode | None) -> None:
        self.phase = "recompute"
        stack.enter_context(_pushed(self))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(recomputing())
        if self.rng is not None:
            stack.enter_context(self.rng.restored())
        stack.enter_context(self.autocast.applied())
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.collect, _identity))
        if replay is not None:
            stack.enter_context(replay)
        stack.enter_context(self.state_guard.guarded())

    def collect(
        self, value: torch.Tensor | Holder, t: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        return uncompiled(self._collect, value, t)

    def _collect(
        self, value: torch.Tensor | Holder, t: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Recompute pack hook: the k-th tensor saved goes into the k-th holder.

        Returns what the recompute's own graph keeps: the tensor, so that a
        function that differentiates internally (``torch.autograd.grad`` inside
        the region) can backpropagate through its recomputed graph.
        """
        index = next(self.recompute_counter)
        tensor = value if isinstance(value, torch.Tensor) else t
        assert tensor is not None, "this is a bug in remat, please report it"
        if self.check:
            self.check_meta(index, tensor)
        kept = tensor.detach()
        holder = self.needed.get(index)
        if holder is not None:
            if isinstance(value, torch.Tensor):
                holder.tensor, holder.version = kept, tensor._version
            else:
                holder.tensor = value
        if index >= self.stop_at:
            raise _StopRecompute
        return kept

    def check_meta(self, index: int, t: torch.Tensor) -> None:
        expected = self.metas[index] if index < len(self.metas) else None
        seen = saved_signature(t, id(t) in self.recompute_input_ids)
        if same_signature(expected, seen):
            return
        stand_in = t.device.type == "meta" and index not in self.needed
        if stand_in and expected is not None and expected[:2] == seen[:2]:
            return  # saved by a dead op's node (a stand-in): nobody will read it
        raise divergence(
            self.region.label,
            f"saved tensor #{index} had {describe_saved(expected)} in the forward, and "
            f"{describe_saved(seen)} in the recompute (debug=True shows both op logs)",
        )

    def check_inputs(self) -> None:
        for position, (t, version) in enumerate(zip(self.inputs, self.versions, strict=True)):
            if _version(t) != version:
                raise SavedInputMutatedError(
                    f"remat: input #{position} of {self.region.label} (shape "
                    f"{tuple(t.shape)}) was modified in place after the forward pass, so it "
                    "cannot be recomputed. Clone it before modifying it, or modify it "
                    "after backward."
                )
        for leaf, version in self.leaf_versions.values():
            if leaf._version != version:
                raise SavedInputMutatedError(
                    f"remat: a parameter of shape {tuple(leaf.shape)} was modified in place "
                    f"after the forward pass of {self.region.label} saved it (or a view of it) "
                    f"(version {leaf._version}, expected {version}; an optimizer step before "
                    "backward?), so its recompute would use the new values. Call backward "
                    "before modifying parameters."
                )
        if self.mutated_in_forward:
            raise SavedInputMutatedError(
                f"remat: {self.region.label} modifies its input in place, so its recompute "
                "would start from the modified value. Clone the input inside the function "
                "before modifying it, or use policy='everything-saveable'."
            )

    def _logs(self, replay: ReplayMode | None) -> str:
        if replay is None or self.log is None:
            return " Pass debug=True to remat.remat to see both op logs."
        return "\n" + side_by_side(self.log.op_names(), [str(f) for f in replay.ran])

    def alive(self) -> list[Holder]:
        """The holders autograd still references (the others were consumed or dropped)."""
        return [h for h in (ref() for ref in self.holders) if h is not None]


def _rewind(rng: RngState) -> None:
    """Put the generators back where ``rng`` captured them (for good, not for a block)."""
    torch.set_rng_state(rng.cpu)
    for device, state in rng.cuda:
        torch.cuda.set_rng_state(state, device)


def _version(t: torch.Tensor) -> int:
    """``t._version``; 0 for an inference tensor (made under ``inference_mode``), which
    has no version counter and cannot be written outside inference mode."""
    return 0 if t.is_inference() else t._version


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _detached(tree: Any) -> Any:
    def detach(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().requires_grad_(leaf.requires_grad)
        return leaf

    return tree_map(detach, tree)


@contextlib.contextmanager
def _pushed(frame: Frame | _KeepEverything) -> Any:
    local.frames.append(frame)
    try:
        yield
    finally:
        local.frames.pop()


def run_eager(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``region.fn(*args, **kwargs)`` so that backward recomputes what the policy drops."""
    fn: Callable[..., Any] = region.fn
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # inference: nothing will be saved
    top = local.frames[-1] if local.frames else None
    if top is not None and top.phase == "forward":
        out = _run_inside(top, fn, args, kwargs)  # the outer region decides (NOTE rule 4)
        check_outputs_visible(flatten_region_io(out)[0], region.label)
        return out
    policy = region.policy
    if _keeps_everything(region):
        with _pushed(_KEEP_EVERYTHING):  # autograd as usual; inner regions run plainly
            return fn(*args, **kwargs)
    inspecting = local.inspecting  # NOTE [ Inspecting a function as it is ] (_inspect)
    frame = Frame(region, args, kwargs) if inspecting is None else inspecting.frame(
        region, args, kwargs
    )
    if top is not None:
        frame.parent = top  # running inside the outer region's recompute
    elif policy.keeps_last_region:
        start_last(frame, frame.inputs)
    out = frame.run_forward()
    if top is None and policy.keeps_last_region:
        mark_outputs(frame, flatten_region_io(out)[0])
    # Autograd would differentiate a tensor in any object, but the torch.func
    # engine cannot see one in an object it cannot flatten: both raise alike.
    check_outputs_visible(flatten_region_io(out)[0], region.label)
    return out


def _run_inside(
    outer: Frame | _KeepEverything, fn: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    log = getattr(outer, "log", None)
    if log is None:
        return fn(*args, **kwargs)
    start = len(log.records)
    out = fn(*args, **kwargs)
    log.inner_region(tensor_leaves((args, kwargs)), start)
    return out


def _keeps_everything(region: Region) -> bool:
    return region.policy.keeps_everything and not region.debug  # debug: keep the op log


class _KeepEverything:
    """Stands on the frame stack while an everything-saveable region runs."""

    phase = "forward"


_KEEP_EVERYTHING = _KeepEverything()
