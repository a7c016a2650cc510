"""The eager engine's frame: its state and what every phase shares (NOTE [ The eager
engine ] in ``__init__.py``)."""

from __future__ import annotations

import contextlib
import enum
import weakref
from typing import Any, Protocol

import torch

from ..._capture.closure import find_closed_over
from ..._capture.module_state import state_guard_of
from ..._compat import no_dispatch_modes, storage_address
from ..._errors import RematError, SavedInputMutatedError
from ..._offload.selection import current_store
from ..._offload.store import Offloaded, next_serial
from ..._pytree import flatten, tree_map
from ..._replay.autocast import AutocastState
from ..._replay.generators import walk_of
from ..._replay.records import OpLog, OpRecord
from ..._replay.rng import RngState, generators_of
from ..._replay.saved_signatures import SavedSignature, check_saved, saved_signature
from ..._state import local
from ..budget_plans import log_policy
from ..offloaded import OffloadedOutputs
from ..region import Region
from .bindings import BoundAtForward

__all__ = ["FrameState", "Holder", "Phase", "TorchFuncInsideError"]


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


class Phase(enum.Enum):
    """Where a frame is: running its forward, running its recompute, or between them."""

    FORWARD = "forward"
    RECOMPUTE = "recompute"
    DONE = "done"


class _StopRecompute(BaseException):
    """Raised inside a recompute once every tensor backward needs has been collected.

    A `BaseException`, like `GeneratorExit`: a user's ``except Exception`` inside
    the region (a fallback path) must not swallow it and run other ops.
    """


class _Unpacks(Protocol):
    """A frame as its holders see it: it gives back what a holder stands for."""

    def unpack(self, holder: Holder) -> torch.Tensor: ...


class _Collects(Protocol):
    """An outer frame whose recompute runs this region (NOTE [ The eager engine ] rule 4)."""

    def collect(
        self, value: torch.Tensor | Holder, t: torch.Tensor | None = None
    ) -> torch.Tensor | None: ...


class Holder:
    """What autograd keeps for one saved tensor of a region."""

    __slots__ = (
        "__weakref__", "clock", "demotable", "frame", "index", "owned", "source", "tensor",
        "version",
    )

    def __init__(self, frame: _Unpacks, index: int) -> None:
        self.frame = frame
        self.index = index
        #: The saved tensor, an inner region's holder (NOTE [ The eager engine ] rule
        #: 4), an offloaded entry (rule 6), or None when dropped.
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


class FrameState:
    """One call of one region: its inputs, its holders, what its phases share.

    The phases add their methods: `FinishingFrame` (end of forward, demotion),
    `RecomputingFrame` (unpack, recompute), `Frame` (forward, pack).
    """

    def __init__(self, region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.region = region
        self.args = args
        self.kwargs = kwargs
        leaves, _ = flatten((args, kwargs))
        self.inputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self.input_ids = {id(t) for t in self.inputs}
        policy = region.policy
        self.log = (
            OpLog(log_policy(region, self.inputs, "eager"), region.label, self.inputs)
            if policy.needs_op_trace or region.debug
            else None
        )
        self.decision = None if policy.needs_op_trace else policy.decision_without_ops()
        #: Whether this frame is the latest save-last region, holding everything (NOTE
        #: [ The save-last chain ] in ``_engines/save_last.py``) until demoted.
        self.holds_all_as_latest = policy.saves_latest_region
        self.holders: list[weakref.ref[Holder]] = []
        self.check = region.determinism_check
        #: The signature of each saved tensor, kept only for the determinism check
        #: (NOTE [ Recompute signatures ] in ``_replay/checks.py``).
        self.metas: list[SavedSignature] = []
        #: Ids of the recompute's (detached) inputs, to sign its saved tensors.
        self.recompute_input_ids: set[int] = set()
        walk = walk_of(region.fn)
        self.rng = (
            RngState.capture(self.inputs, generators_of(region.fn, leaves, walk))
            if region.preserve_rng_state
            else None
        )
        #: The tensors ``fn`` reached through bindings, for the recompute (NOTE
        #: [ Bindings the recompute reads ] in ``bindings.py``).
        self.bound = BoundAtForward.capture(region.fn, walk)
        #: The generators' states when the forward ended: did it draw random numbers?
        self.rng_after: RngState | None = None
        self.autocast = AutocastState.capture()
        self.state_guard = state_guard_of(region.fn, leaves, region.label)
        self.versions: list[int] = []
        #: Tensors the region reads without receiving them (closures, globals,
        #: attributes), by id, with where they were found; None until needed.
        self.outside: dict[int, str] | None = None
        #: Ids of outside tensors in modules' parameter and buffer tables (`check_rebound`).
        self.outside_module_state: set[int] = set()
        #: Holders of outside tensors the recompute must find bound still.
        self.rebind_checked: set[int] = set()
        #: Holders of saved tensors without a ``grad_fn`` that nothing referenced at
        #: the end of the forward, and the recompute's tensors for them (weakly).
        self.unreferenced: set[int] = set()
        self.recomputed_unreferenced: list[tuple[int, weakref.ref[torch.Tensor]]] = []
        #: Saved holders of such tensors, by index: where the tensor was found.
        self.outside_names: dict[int, str] = {}
        #: Parameters (leaves requiring grad) the forward saved views of.
        self.leaf_versions: dict[int, tuple[torch.Tensor, int]] = {}
        self.mutated_in_forward = False
        #: Whether autograd ran a backward while the forward saved tensors
        #: (``torch.autograd.grad`` inside ``fn``): the recompute then watches it.
        self.inner_backward = False
        #: The frame whose recompute is running this region (NOTE [ The eager engine ]
        #: rule 4), if any.
        self.parent: _Collects | None = None
        self.phase = Phase.FORWARD
        self.recompute_counter: Any = None
        self.needed: dict[int, Holder] = {}
        #: Whether the running recompute's replay releases what it replays (NOTE [ The
        #: eager engine ] rule 7): not in a recompute inside the forward.
        self.replay_releases = False
        self.stop_at = -1
        store = current_store(region.offload_store)
        #: Offloaded op outputs (NOTE [ Offloaded outputs ]); the serial orders this
        #: frame's after earlier frames'.
        self.offloaded = OffloadedOutputs(lambda: store, no_dispatch_modes, next_serial())

    def alive(self) -> list[Holder]:
        """The holders autograd still references (the others were consumed or dropped)."""
        return [h for h in (ref() for ref in self.holders) if h is not None]

    def liveness(self, alive: list[Holder] | None = None) -> list[bool]:
        assert self.log is not None, "this is a bug in remat, please report it"
        if alive is None:
            alive = self.alive()
        needed = [h.source[0].index for h in alive if h.tensor is None and h.source]
        live = self.log.liveness(needed)
        clock = max((h.clock for h in alive if h.tensor is None), default=0)
        return [is_live and i < clock for i, is_live in enumerate(live)]

    def release_unread(self, live: list[bool] | None = None) -> None:
        # A kept output that no live op of the recompute reads is never replayed
        # (holders reference what backward itself reads): let it go. ``live``: the
        # liveness, if the caller has it for the holders as they are now.
        assert self.log is not None, "this is a bug in remat, please report it"
        if live is None:
            live = self.liveness()
        for record, is_live in zip(self.log.records, live, strict=True):
            if not is_live:
                record.release()

    def can_offload(self, t: torch.Tensor) -> bool:
        if self.parent is not None or self.log is None or not self.offloaded.store.accepts(t):
            return False
        base = t._base
        # A view of a parameter or an input frees nothing when copied away.
        return base is None or not (
            id(base) in self.input_ids or (base.is_leaf and base.requires_grad)
        )

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

    def check_rebound(self, index: int, recomputed: torch.Tensor) -> None:
        """A tensor the region found without receiving it is the same in the recompute.

        The forward kept it (a closure, a global, a dict entry, an attribute), so an
        in-place write is caught by its version. A *rebinding* (a new tensor assigned
        to the name, key or attribute) is not a write: the recompute reads the new
        tensor and would differentiate a forward that never ran. The torch.func
        engine passes such tensors as inputs of its Function and is not affected.
        """
        if index not in self.rebind_checked:
            return
        holder = self.holders[index]()
        if holder is None or not isinstance(holder.tensor, torch.Tensor):
            return
        before, now = storage_address(holder.tensor), storage_address(recomputed)
        if before == now or 0 in (before, now) or self.state_guard.gives(recomputed):
            return  # (the guard's copy of a slot the forward wrote: what it read there)
        where = self.outside_names[index]
        raise SavedInputMutatedError(
            f"remat: {where} was rebound after the forward pass of {self.region.label} "
            f"read it: the recompute reads a different tensor (saved tensor #{index}, "
            f"shape {tuple(recomputed.shape)}), so the gradient would be that of a forward "
            "that did not run. Assign the new tensor after backward, pass the tensor to "
            "the region as an argument, or use policy='everything-saveable' for this region."
        )

    def note_unreferenced(self, index: int, recomputed: torch.Tensor) -> None:
        if index in self.unreferenced and recomputed.grad_fn is None:
            self.recomputed_unreferenced.append((index, weakref.ref(recomputed)))

    def check_unbound(self) -> None:
        """After a recompute: a tensor the forward's saved slot had no reference to is
        not now bound outside the region.

        An op's own output (layer norm's mean) is as unreferenced after the
        recompute as after the forward. One the recompute still reaches through a
        global, a closure or a dict is what the binding gives *now*: the forward
        read another tensor there and rebound it (``cache['w'] = new`` inside the
        region), so the recompute differentiated a forward that did not run. Only
        a tensor still alive is looked up, so the walk runs only then.
        """
        recomputed, self.recomputed_unreferenced = self.recomputed_unreferenced, []
        alive = [(index, t) for index, ref in recomputed if (t := ref()) is not None]
        if not alive:
            return
        bindings = find_closed_over(self.region.fn)
        reached, module_state = bindings.reached(), bindings.module_state()
        for index, t in alive:
            where = reached.get(id(t))
            if where is not None and id(t) not in module_state:
                raise SavedInputMutatedError(
                    f"remat: {where} was rebound after the forward pass of "
                    f"{self.region.label} read it (saved tensor #{index}, shape "
                    f"{tuple(t.shape)}): the recompute reads the new tensor, so the "
                    "gradient would be that of a forward that did not run. Assign the "
                    "new tensor after backward, pass the tensor to the region as an "
                    "argument, or use policy='everything-saveable' for this region."
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

    def check_meta(self, index: int, t: torch.Tensor) -> None:
        expected = self.metas[index] if index < len(self.metas) else None
        seen = saved_signature(t, id(t) in self.recompute_input_ids)
        if expected == seen:  # the usual case, without building the check's closures
            return
        # Saved by a dead op's node (a stand-in): nobody will read it.
        unread = t.device.type == "meta" and index not in self.needed
        check_saved(self.region.label, index, expected, seen, unread)


class _PlainRun:
    """Stands on the frame stack while a region runs as plain autograd (`run_plain`)."""

    phase = Phase.FORWARD


_PLAIN_RUN = _PlainRun()


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
def _pushed(frame: FrameState | _PlainRun) -> Any:
    local.frames.append(frame)
    try:
        yield
    finally:
        local.frames.pop()
