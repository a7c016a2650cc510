"""The eager engine: a region's policy applied through saved-tensor hooks.

NOTE [ The eager engine ]
1. Forward: ``fn`` runs with grad enabled under `saved_tensors_hooks` (and a
   `RecordMode` when the policy looks at ops or names). Every tensor autograd
   saves goes through `_Frame.pack`, which returns a `_Holder`: it holds the
   tensor when the policy keeps it (region inputs and parameters are always
   kept: they are alive anyway), and nothing when the policy drops it.
2. Backward: the first `_Frame.unpack` of an empty holder recomputes the region
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
   produced, marked demotable; when the next such region starts its forward,
   the previous one is demoted: demotable holders are emptied and recompute
   armed.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._autocast import AutocastState
from .._errors import NondeterministicRecomputeError, RematError, SavedInputMutatedError
from .._pytree import tensor_leaves, tree_map
from .._region import Region
from .._replay import OpLog, OpRecord, RecordMode, ReplayMode, side_by_side
from .._rng import RngState
from .._state import local, recomputing
from ..policies import Decision

__all__ = ["run_eager"]


class _StopRecompute(Exception):
    """Raised inside a recompute once every tensor backward needs has been collected."""


class _Holder:
    """What autograd keeps for one saved tensor of a region."""

    __slots__ = ("__weakref__", "clock", "demotable", "frame", "index", "source", "tensor")

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame = frame
        self.index = index
        #: The saved tensor, an inner region's holder (rule 4), or None when dropped.
        self.tensor: torch.Tensor | _Holder | None = None
        #: The record and output position of the op that produced the tensor.
        self.source: tuple[OpRecord, int] | None = None
        #: Ops recorded before this tensor was saved (the recompute must run that far).
        self.clock = 0
        self.demotable = False


class _Frame:
    """One call of one region: its inputs, its holders, and how to recompute them."""

    def __init__(self, region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.region = region
        self.args = args
        self.kwargs = kwargs
        self.inputs = tensor_leaves((args, kwargs))
        self.input_ids = {id(t) for t in self.inputs}
        policy = region.policy
        self.log = OpLog(policy, region.label) if policy.needs_op_trace or region.debug else None
        self.decision = None if policy.needs_op_trace else policy.decision_without_ops()
        self.keep_all = policy.keeps_last_region
        self.holders: list[weakref.ref[_Holder]] = []
        self.metas: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.rng = RngState.capture(self.inputs) if region.preserve_rng_state else None
        self.autocast = AutocastState.capture()
        self.versions: list[int] = []
        self.mutated_in_forward = False
        #: The frame whose recompute is running this region (rule 4), if any.
        self.parent: _Frame | None = None
        self.phase = "forward"
        self.recompute_counter: Any = None
        self.needed: dict[int, _Holder] = {}
        self.stop_at = -1

    # -- forward -------------------------------------------------------------

    def run_forward(self) -> Any:
        start_versions = [t._version for t in self.inputs]
        self.versions = start_versions
        with contextlib.ExitStack() as stack:
            stack.enter_context(_pushed(self))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
            if self.log is not None:
                stack.enter_context(RecordMode(self.log))
            out = self.region.fn(*self.args, **self.kwargs)
        self.versions = [t._version for t in self.inputs]
        self.mutated_in_forward = self.versions != start_versions
        self.phase = "done"
        self.finish_forward()
        return out

    def pack(self, t: torch.Tensor) -> _Holder:
        holder = _Holder(self, len(self.holders))
        self.holders.append(weakref.ref(holder))
        self.metas.append((t.shape, t.dtype, t.device))
        if self.log is not None:
            holder.clock = len(self.log.records)
        if self.decide(t, holder) is not Decision.RECOMPUTE:
            holder.tensor = t.detach()
        if self.parent is not None:
            self.parent.collect(holder, t)
        return holder

    def decide(self, t: torch.Tensor, holder: _Holder) -> Decision:
        if id(t) in self.input_ids or (t.is_leaf and t.requires_grad):
            return Decision.SAVE  # alive anyway: keeping a reference costs nothing
        if self.log is not None:
            holder.source = self.log.lookup(t)
            if holder.source is None:
                return Decision.SAVE  # made outside the region: a closure or a global
            record, position = holder.source
            decision = record.decision_at(position)
        else:
            assert self.decision is not None, "this is a bug in remat, please report it"
            decision = self.decision
        if decision is Decision.OFFLOAD:
            decision = Decision.SAVE  # the host store of real offload plugs in here
        if self.keep_all and decision is Decision.RECOMPUTE:
            holder.demotable = True
            return Decision.SAVE
        return decision

    def finish_forward(self) -> None:
        """Fill holders named after they were saved; release kept ops nothing reads."""
        if self.log is None:
            return
        for holder in self._alive():
            if holder.tensor is None and holder.source is not None:
                record, position = holder.source
                if record.kept is not None and record.kept[position] is not None:
                    holder.tensor = record.kept[position]
        if not self.keep_all:
            self.release_unread()

    def release_unread(self) -> None:
        # The recompute stops at the last empty holder: kept outputs of later ops
        # are never replayed, and holders reference what backward itself reads.
        assert self.log is not None, "this is a bug in remat, please report it"
        clock = max((h.clock for h in self._alive() if h.tensor is None), default=0)
        for record in self.log.records[clock:]:
            record.release()

    def demote(self) -> None:
        """Stop being the last `save_last` region: drop what only that status kept."""
        self.keep_all = False
        for holder in self._alive():
            if holder.demotable:
                holder.tensor = None
                holder.demotable = False
        if self.log is not None:
            self.release_unread()

    # -- backward ------------------------------------------------------------

    def unpack(self, holder: _Holder) -> torch.Tensor:
        if holder.tensor is None:
            self.recompute()
        value = holder.tensor
        if isinstance(value, _Holder):
            return value.frame.unpack(value)
        if value is None:
            raise RematError(
                f"remat: the recompute of {self.region.label} did not produce saved tensor "
                f"#{holder.index}. This is a bug in remat, please report it."
            )
        return value

    def recompute(self) -> None:
        self.needed = {h.index: h for h in self._alive() if h.tensor is None}
        if not self.needed:
            return
        self.check_inputs()
        self.stop_at = max(self.needed)
        self.recompute_counter = itertools.count()
        replay = ReplayMode(self.log, self.region.determinism_check) if self.log else None
        try:
            with self._recompute_context(replay):
                self.region.fn(*_detached(self.args), **_detached(self.kwargs))
        except _StopRecompute:
            pass
        finally:
            self.phase = "done"
        missing = [i for i, h in self.needed.items() if h.tensor is None]
        if missing:
            raise NondeterministicRecomputeError(
                f"remat: the recompute of {self.region.label} saved fewer tensors than its "
                f"forward ({next(self.recompute_counter)} instead of {len(self.metas)}): "
                "the function ran different ops the second time. Make its control flow "
                "depend only on its inputs, or use policy='everything-saveable'."
                + self._logs(replay)
            )

    def _recompute_context(self, replay: ReplayMode | None) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        self.phase = "recompute"
        stack.enter_context(_pushed(self))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(recomputing())
        if self.rng is not None:
            stack.enter_context(self.rng.restored())
        stack.enter_context(self.autocast.applied())
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.collect, _unreachable))
        if replay is not None:
            stack.enter_context(replay)
        return stack

    def collect(self, value: torch.Tensor | _Holder, t: torch.Tensor | None = None) -> None:
        """Recompute pack hook: the k-th tensor saved goes into the k-th holder."""
        index = next(self.recompute_counter)
        tensor = value if isinstance(value, torch.Tensor) else t
        assert tensor is not None, "this is a bug in remat, please report it"
        if self.region.determinism_check:
            self.check_meta(index, tensor)
        holder = self.needed.get(index)
        if holder is not None:
            holder.tensor = value.detach() if isinstance(value, torch.Tensor) else value
        if index >= self.stop_at:
            raise _StopRecompute

    def check_meta(self, index: int, t: torch.Tensor) -> None:
        expected = self.metas[index] if index < len(self.metas) else None
        if expected == (t.shape, t.dtype, t.device):
            return
        seen = "nothing (the forward saved fewer tensors)"
        if expected is not None:
            seen = f"shape {tuple(expected[0])}, {expected[1]} on {expected[2]}"
        raise NondeterministicRecomputeError(
            f"remat: the recompute of {self.region.label} differs from its forward: saved "
            f"tensor #{index} had {seen} in the forward, and shape {tuple(t.shape)}, "
            f"{t.dtype} on {t.device} in the recompute. The function must compute the "
            "same thing every call: make control flow depend only on its inputs and "
            "static arguments, or use policy='everything-saveable' for this region. "
            "Pass debug=True to remat.remat to see both op logs."
        )

    def check_inputs(self) -> None:
        for position, (t, version) in enumerate(zip(self.inputs, self.versions, strict=True)):
            if t._version != version:
                raise SavedInputMutatedError(
                    f"remat: input #{position} of {self.region.label} (shape "
                    f"{tuple(t.shape)}) was modified in place after the forward pass, so it "
                    "cannot be recomputed. Clone it before modifying it, or modify it "
                    "after backward."
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

    def _alive(self) -> list[_Holder]:
        return [h for h in (ref() for ref in self.holders) if h is not None]


def _unreachable(_: object) -> torch.Tensor:
    raise AssertionError("remat: a recompute graph was unpacked; this is a bug in remat")


def _detached(tree: Any) -> Any:
    def detach(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().requires_grad_(leaf.requires_grad)
        return leaf

    return tree_map(detach, tree)


@contextlib.contextmanager
def _pushed(frame: _Frame | _KeepEverything) -> Any:
    local.frames.append(frame)
    try:
        yield
    finally:
        local.frames.pop()


def _demote_previous(frame: _Frame) -> None:
    previous = local.last_region() if local.last_region is not None else None
    if previous is not None and previous is not frame:
        previous.demote()
    local.last_region = weakref.ref(frame)


def run_eager(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``region.fn(*args, **kwargs)`` so that backward recomputes what the policy drops."""
    fn: Callable[..., Any] = region.fn
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # inference: nothing will be saved
    top = local.frames[-1] if local.frames else None
    if top is not None and top.phase == "forward":
        return fn(*args, **kwargs)  # the outer region decides (NOTE rule 4)
    policy = region.policy
    if _keeps_everything(region):
        with _pushed(_KEEP_EVERYTHING):  # autograd as usual; inner regions run plainly
            return fn(*args, **kwargs)
    frame = _Frame(region, args, kwargs)
    if top is not None:
        frame.parent = top  # running inside the outer region's recompute
    elif policy.keeps_last_region:
        _demote_previous(frame)
    return frame.run_forward()


def _keeps_everything(region: Region) -> bool:
    policy = region.policy
    if policy.needs_op_trace or policy.keeps_last_region or region.debug:
        return False
    return policy.decision_without_ops() is not Decision.RECOMPUTE


class _KeepEverything:
    """Stands on the frame stack while an everything-saveable region runs."""

    phase = "forward"


_KEEP_EVERYTHING = _KeepEverything()
