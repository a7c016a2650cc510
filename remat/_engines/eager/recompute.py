"""The recompute phase: the first unpack of an empty holder reruns the region (NOTE [ The
eager engine ] rules 2 and 4 in ``__init__.py``)."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch

from ..._compat import no_dispatch_modes
from ..._compile import runs_plainly, uncompiled
from ..._errors import NondeterministicRecomputeError, RematError
from ..._offload.store import Offloaded
from ..._pytree import tensor_leaves
from ..._replay.checks import differs
from ..._replay.modes import ReplayMode, detached, side_by_side
from ..._replay.rng import check_batched_recompute
from ..._replay.saved_signatures import same_signature, saved_signature
from ..._replay.stand_ins import raise_if_leaked
from ..autograd_inside import GradWatch, OutsideGradError, feeds
from ..recompute import recompute_context
from .bindings import refusing_moved
from .finish import FinishingFrame
from .skipped_saves import SkipMatcher, dead_holders
from .state import (
    Holder,
    Phase,
    _detached,
    _identity,
    _pushed,
    _StopRecompute,
)


class RecomputingFrame(FinishingFrame):
    """Unpack and recompute: backward asks for what a frame's holders stand for."""

    #: While a recompute matches its saved tensors to the holders by `SkipMatcher`
    #: (NOTE [ Saved tensors the recompute may skip ]): the matcher, and each save.
    skipping: SkipMatcher | None = None
    skipped: list[tuple[torch.Tensor | Holder, torch.Tensor]] | None = None

    def unpack(self, holder: Holder) -> torch.Tensor:
        # A ``loss.backward()`` inside compiled code runs this hook where Dynamo
        # would compile the recompute (see ``_compile.py``).
        if runs_plainly():
            return self._unpack(holder)
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

    def recompute(self) -> None:
        alive = self.alive()
        self.needed = {h.index: h for h in alive if h.tensor is None}
        if not self.needed:
            return
        self.check_inputs()
        # Eager regions run outside every transform: any vmap now is new.
        check_batched_recompute(self.rng, self.rng_after, frozenset(), self.region.label)
        self.stop_at = max(self.needed)
        restored = self.offloaded.restore(before=max(h.clock for h in self.needed.values()))
        live = self.liveness(alive) if self.log is not None else None
        # Backward inside the region's own forward (``torch.autograd.grad`` in
        # ``fn``): the recording mode must not see the recompute's ops, and the
        # log must keep what it kept (the forward goes on recording).
        in_forward = self.phase is Phase.FORWARD
        self.replay_releases = not in_forward
        replay = self._replay(live)
        try:
            with no_dispatch_modes() if in_forward else contextlib.nullcontext():
                try:
                    refusing = refusing_moved(self.bound, self.region.label, self.state_guard)
                    with _grad_watch(self), refusing:
                        try:
                            self._recompute_or_retry(replay, live)
                        except NondeterministicRecomputeError:
                            # Saved tensors a forward-only statistic's graph dropped?
                            if not self._recompute_skipping():
                                raise
                        else:
                            # By identity: ``None in [...]`` would compare each tensor
                            # with ``==``, a torch op per saved tensor (+27M
                            # instructions per step on the 8-block stack).
                            if any(h.tensor is None for h in self.needed.values()):
                                self._recompute_skipping()  # else raises below
                except RuntimeError:
                    _explain_outside_grad(self)
                    raise
                if any(h.tensor is None for h in self.needed.values()):
                    _explain_outside_grad(self)
        finally:
            self.phase = Phase.FORWARD if in_forward else Phase.DONE
            self.offloaded.drop(restored)  # the collected holders keep what they need
        missing = [i for i, h in self.needed.items() if h.tensor is None]
        # Holders point back at the frame: keeping them would be a cycle that
        # holds every recomputed tensor until the garbage collector runs.
        self.needed = {}
        if missing:
            raise differs(
                self.region.label, "the number of tensors it saved", len(self.holders),
                next(self.recompute_counter), ": it ran different ops the second time",
                self._logs(replay),
            )
        if not in_forward:
            self.release_replayed()

    def release_replayed(self) -> None:
        """After a recompute: the log lets go of every kept output (NOTE [ The eager
        engine ] rule 7).

        Every holder backward still references is full now, so no recompute reads
        the kept outputs again unless a holder empties (a kept tensor written in
        place, a demotion): that recompute runs the ops again, from the region's
        inputs, with every check. What backward reads, its holders keep, and each
        goes as backward consumes its holder instead of when the region's whole
        graph is freed.
        """
        if self.log is None:
            return
        for record in self.log.records:
            record.release()
        self.offloaded.prune()

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
        except Exception as error:
            serial = None if self.log is None else self.log.serial
            if live is None or all(live):
                # Another recompute's stand-in kept in Python state (NOTE [ Stand-ins in
                # Python state ] in ``_replay/stand_ins.py``)?
                raise_if_leaked(self.region.label, serial, error)
                raise
            # A dead op's stand-in reached Python (``tolist()``, state kept on an
            # object): run every op this time (NOTE [ Record and replay ] rule 5).
            try:
                self._run_recompute(self._replay(None))
            except RematError:
                raise
            except Exception as again:
                raise_if_leaked(self.region.label, serial, again)
                raise

    def _recompute_skipping(self) -> bool:
        """Recompute again, leaving out dead holders (NOTE [ Saved tensors the recompute may
        skip ]); whether every reading agreed, and the needed holders are full."""
        dead = dead_holders([ref() for ref in self.holders])
        if not dead or not self.needed:
            return False
        for emptied in self.needed.values():  # what the failed recompute put there
            emptied.tensor, emptied.version = None, 0
        self.recomputed_unreferenced = []
        self.skipping = SkipMatcher(len(self.holders), dead, set(self.needed))
        self.skipped = []
        try:
            # Every op it does not replay runs (no stand-ins): the failed recompute
            # released what it replayed, and a stand-in may have been what differed.
            self._run_recompute(self._replay(None))
            found = self.skipping.result()
            saves = self.skipped
        except _NoReading:
            found, saves = None, []
        finally:
            self.skipping = self.skipped = None
        if found is None:
            return False
        for index, k in sorted(found.items()):
            value, tensor = saves[k]
            if self.rebind_checked:
                self.check_rebound(index, tensor)
            if self.unreferenced:
                self.note_unreferenced(index, tensor)
            holder = self.needed.get(index)
            if holder is not None:
                _fill(holder, value, tensor)
        if self.recomputed_unreferenced:
            self.check_unbound()
        return True

    def _collect_skipping(
        self, skipping: SkipMatcher, value: torch.Tensor | Holder, tensor: torch.Tensor
    ) -> torch.Tensor:
        """Recompute pack hook while matching by `SkipMatcher`: note the save, fill nothing."""
        seen = saved_signature(tensor, id(tensor) in self.recompute_input_ids)
        stand_in = tensor.device.type == "meta"

        def fits(index: int) -> bool:
            expected = self.metas[index] if index < len(self.metas) else None
            if same_signature(expected, seen):
                return True
            # A dead op's stand-in that no backward reads: shape and dtype (`check_meta`).
            unread = stand_in and index not in self.needed
            return unread and expected is not None and expected[:2] == seen[:2]

        if not skipping.save(fits):
            raise _NoReading
        kept = detached(tensor)
        assert self.skipped is not None, "this is a bug in remat, please report it"
        self.skipped.append((value if isinstance(value, Holder) else kept, tensor))
        if skipping.done():
            raise _StopRecompute
        return kept

    def _replay(self, live: list[bool] | None) -> ReplayMode | None:
        if self.log is None:
            return None
        held = None
        if live is not None:  # what holders keep of dead ops: no stand-ins for those
            held = {
                (h.source[0].index, h.source[1]): h.tensor
                for h in self.alive()
                if h.source and isinstance(h.tensor, torch.Tensor) and not live[h.source[0].index]
            }
        return ReplayMode(
            self.log, self.region.determinism_check, live, held, release=self.replay_releases
        )

    def _run_recompute(self, replay: ReplayMode | None) -> None:
        self.recompute_counter = itertools.count()
        try:
            args, kwargs = _detached(self.args), _detached(self.kwargs)
            self.recompute_input_ids = {id(t) for t in tensor_leaves((args, kwargs))}
            with self._recompute_context(replay):
                self.region.fn(*args, **kwargs)
        except _StopRecompute:
            pass  # every holder the backward needs is full (NOTE [ The eager engine ] rule 2)
        if self.recomputed_unreferenced:
            self.check_unbound()

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
        self.phase = Phase.RECOMPUTE
        stack.enter_context(_pushed(self))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.collect, _identity))
        stack.enter_context(recompute_context(self.rng, self.autocast, replay, grad=True))
        stack.enter_context(self.state_guard.guarded())

    def collect(
        self, value: torch.Tensor | Holder, t: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        if runs_plainly():
            return self._collect(value, t)
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
        if self.skipping is not None:
            return self._collect_skipping(self.skipping, value, tensor)
        if self.check:
            self.check_meta(index, tensor)
        if self.rebind_checked:
            self.check_rebound(index, tensor)
        if self.unreferenced:
            self.note_unreferenced(index, tensor)
        kept = detached(tensor)
        holder = self.needed.get(index)
        if holder is not None:  # (inline, not `_fill`: once per saved tensor)
            if isinstance(value, torch.Tensor):
                holder.tensor, holder.version = kept, tensor._version
            else:
                holder.tensor = value
        if index >= self.stop_at:
            raise _StopRecompute
        return kept

    def _logs(self, replay: ReplayMode | None) -> str:
        if replay is None or self.log is None:
            return " Pass debug=True to remat.remat to see both op logs."
        return "\n" + side_by_side(self.log.op_names(), [str(f) for f in replay.ran])


class _NoReading(Exception):
    """No reading of the recompute's saved tensors is left, or too many are."""


def _fill(holder: Holder, value: torch.Tensor | Holder, tensor: torch.Tensor) -> None:
    """Put a recompute's saved tensor (detached: ``value``) or inner holder into ``holder``."""
    if isinstance(value, Holder):
        holder.tensor = value
    else:
        holder.tensor, holder.version = value, tensor._version


def _grad_watch(frame: RecomputingFrame) -> contextlib.AbstractContextManager[Any]:
    """A `GradWatch` for a recompute whose forward ran a backward, else nothing.

    A tensor reaching ``fn`` both directly and through a non-leaf argument
    would get, in the recompute, a gradient without the second path: wrong,
    and silent. Only regions whose forward ran a backward pay for the watch.
    """
    outer = [t for t in frame.inputs if t.grad_fn is not None]
    if not frame.inner_backward or not outer:
        return contextlib.nullcontext()
    return GradWatch(frame.region.label, lambda t: feeds(t, outer))


def _explain_outside_grad(frame: RecomputingFrame) -> None:
    """The recompute failed: raise `OutsideGradError` if that is why.

    ``fn`` may call ``torch.autograd.grad`` with respect to a tensor that
    reaches it only through a non-leaf argument (NOTE in ``_engines/autograd_inside.py``):
    the forward saw that path, the recompute (on detached arguments) cannot.
    Run again, watching those calls, only on this failure path: the watch is
    a mode that would cost every recompute a Python call per op.
    """
    outer = [t for t in frame.inputs if t.grad_fn is not None]
    if not outer:
        return
    watch = GradWatch(frame.region.label, lambda t: feeds(t, outer))
    try:
        with watch:
            frame._run_recompute(frame._replay(None))
    except OutsideGradError:
        raise
    except Exception:  # another failure: the caller raises the original
        return
