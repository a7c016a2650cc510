"""One call of a region under the torch.func engine.

Everything about the call that is not a tensor input of the Function: the
user's arguments and closure, the forward's record, its RNG and autocast
state, its offloaded outputs (NOTE [ The functional engine ] in ``__init__.py``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ..._capture.closure import Bindings, find_closed_over
from ..._capture.module_state import restored_ids_of, state_guard_of
from ..._compat import interpreters
from ..._offload.selection import current_store
from ..._policy.name_check import check_names
from ..._pytree import check_outputs_visible, flatten_region_io
from ..._replay.autocast import AutocastState
from ..._replay.checks import OpTrace, differs
from ..._replay.generators import Walk, walk_of
from ..._replay.modes import RecordMode, ReplayMode
from ..._replay.records import OpLog
from ..._replay.rng import RngState, generators_of, vmap_levels
from ..._state import internal
from ..budget_plans import settle
from ..escapes import EscapeWatch
from ..offloaded import OffloadedOutputs
from ..recompute import recompute_context
from ..region import Region
from ..save_last import become_latest
from .arguments import Arguments, _argument_objects, _outer_views
from .autocast_inside import AutocastInside
from .constants import constant_outputs
from .differentiated import run_as_differentiated
from .guard import _Births, _HiddenInputGuard, unsubstituted_error
from .held import HeldGraph, may_hold
from .levels import _below_all_levels, _escape_seeds, _inference_mode_errors, _tracked
from .lifetime import Backwards
from .observed import note_outputs
from .recording import _new_log, offload_at_forward_end
from .submodules import SubmodulesAtForward
from .substitution import _Substitution
from .views import OutputViews


class _Call:
    """Everything about one call that is not a tensor input of the Function."""

    def __init__(
        self,
        region: Region,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        bindings: Bindings | None = None,
    ) -> None:
        self.region = region
        #: Tensors ``fn`` lets out besides its outputs (NOTE [ Escaped tensors ]).
        self.escapes = EscapeWatch(region.label)
        self.fn = self.escapes.counted(fn)
        #: The user's function (``self.fn`` numbers its calls), for the generator search.
        self.user_fn = fn
        #: The user's own arguments: ``fn`` runs on them, not on copies
        #: (NOTE [ The functional engine ] rule 2).
        self.arguments = Arguments(args, kwargs)
        tree: Any = (args, kwargs)
        leaves: list[Any] = flatten_region_io(tree)[0]
        self.leaves = leaves
        self.tensor_count = sum(isinstance(x, torch.Tensor) for x in leaves)
        #: The submodules ``fn`` reached, checked before each recompute (``submodules.py``);
        #: a vmap twin (given its bindings) runs the original call, which checks.
        self.submodules: SubmodulesAtForward | None = None
        self.walk: Walk | None = None
        if bindings is None:
            bindings = find_closed_over(fn, _argument_objects(leaves, region.label))
            self.walk = walk_of(fn)
            self.submodules = SubmodulesAtForward.capture(fn, self.walk)
        self.bindings: Bindings = bindings
        #: Module buffers, closure cells and ``.grad`` the forward changes, changed
        #: once (NOTE [ State the forward changes ] in ``_capture/module_state.py``).
        # No ``.grad`` watch: torch refuses ``.backward()`` inside a transform.
        self.state = state_guard_of(fn, leaves, region.label, grads=False)
        #: The tensors as ``fn`` reaches them: the ones each op gets substituted.
        self.originals: tuple[torch.Tensor, ...] = (
            *(x for x in leaves if isinstance(x, torch.Tensor)),
            *self.bindings.tensors,
        )
        self.original_ids = {id(t) for t in self.originals}
        #: Every tensor found in the closure, tracked or not (for the version check).
        self.reached = self.bindings.reached()
        #: What the Function is given: inside another region's run (a nested region)
        #: the tensors ``fn`` reaches are the outer substitution's views of them.
        self.inputs: tuple[torch.Tensor, ...] = _outer_views(self.originals)
        #: Per op of the first run (the forward): which leaves were which input.
        self.reads: list[tuple[Any, tuple[tuple[int, int], ...]]] | None = None
        #: Inputs the backward will differentiate (NOTE [ The functional engine ] rule 7).
        self.differentiated = [i for i, t in enumerate(self.inputs) if _tracked(t)]
        #: Whether a backward will come (of this call, or of the call a vmap twin is for).
        self.differentiable = bool(self.differentiated)
        #: Inputs whose dependents, let out, must carry derivatives (NOTE [ Escaped tensors ]).
        self.escape_seeds = _escape_seeds(self.inputs, self.differentiated)
        self.out_treedef: Any = None
        self.out_leaves: list[Any] = []
        self.out_positions: list[int] = []
        self.log: OpLog | None = None
        #: The latest ``save-last`` region's forward graph, held instead of a log
        #: (NOTE [ The functional engine ] rule 6, ``held.py``).
        self.held: HeldGraph | None = None
        #: Whether this is a vmap rule's twin (NOTE [ The functional engine ] rule 10).
        self.batched = False
        #: The transforms live at the call, (kind, level), for the vmap rule
        #: (NOTE [ The functional engine ] rule 10).
        self.transforms = [(i.key(), i.level()) for i in interpreters()]
        #: Levels live where the region was called: a wrapper at one of them that
        #: ``fn`` uses inside the forward must be an input (NOTE [ The functional engine ] rule 2).
        self.outer_levels = {level for _, level in self.transforms}
        #: The backwards that may still read the forward's records (rule 13).
        self.backwards = Backwards(self.transforms)
        self.guard: _HiddenInputGuard | None = None
        #: Positions of the floating outputs no input's gradient flows to (``h.detach()``):
        #: non-differentiable, as without remat (``constants.py``).
        self.constant_outputs: set[int] = set()
        #: Outputs that are views of another output, made again after ``apply`` (``views.py``).
        self.views: OutputViews | None = None
        #: The outputs the user has, weakly (`note_outputs`).
        self.output_refs: list[weakref.ref[torch.Tensor]] = []
        self.rng: RngState | None = None
        #: The generators' states when the forward ended, and its vmap levels.
        self.rng_after: RngState | None = None
        self.vmap_levels = vmap_levels()
        self.autocast = AutocastState.capture()
        #: Offloaded kept outputs (NOTE [ The functional engine ] rule 8, NOTE [ Offloaded outputs ]
        #: in ``_engines/offloaded.py``).
        self.offloaded = OffloadedOutputs(
            lambda: current_store(region.offload_store), _below_all_levels
        )
        #: The forward's torch calls, which every recompute must repeat (NOTE [
        #: Recompute signatures ] in ``_replay/checks.py``).
        self.trace = OpTrace(region.label, region.determinism_check)

    def run(
        self, tensors: Sequence[torch.Tensor], writable: dict[int, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Call ``fn`` with ``tensors`` in place of the inputs; return its tensor outputs.

        ``writable``: more substitutions, by id (the recorded forward's module buffers
        wrapped at its ``vjp`` level, ``differentiated.py``)."""
        table = {
            id(o): t for o, t in zip(self.originals, tensors, strict=True) if o is not t
        }
        if writable:
            table.update(writable)
        first = self.reads is None
        if not first:  # a recompute: what the forward saw, though slots were rebound since
            if self.submodules is not None:
                self.submodules.check(self.region.label)
            self.bindings.check_versions(
                self.region.label, restored_ids_of(self.user_fn, self.state)
            )
            # Held while the table is: it is keyed by their ids (`Bindings.remap`).
            keys_alive: list[torch.Tensor] = []
            table.update(
                self.bindings.remap(tensors[self.tensor_count :], self.region.label, keys_alive)
            )
        substitution = _Substitution(self, table, tensors)
        modes = (  # the modules' modes as the forward ran them (``model.eval()`` since)
            self.submodules.restored()
            if not first and self.submodules is not None
            else contextlib.nullcontext()
        )
        try:
            # The substitution outermost: the state guard's own copies (a recompute's
            # linked copy of a parameter) read the Function's views too.
            with substitution, modes, self.state.guarded(), self.trace.watching(), \
                    _inference_mode_errors(self.region):
                args, kwargs = self.arguments.with_views(table)
                out = self.fn(*args, **kwargs)
        except RuntimeError as e:
            if "wrapped->level() < level" not in str(e):
                raise
            raise unsubstituted_error(self) from e
        if first:
            self.reads = substitution.reads
            self.bindings.note_versions(substitution.used)
        out_leaves, out_treedef = flatten_region_io(out)
        # Who made each output, in the forward and in each recompute (NOTE [ Recompute
        # signatures ] rule 3).
        made = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        self.trace.outputs(made)
        if first and not self.transforms and not self.batched:  # ``constants.py``
            self.constant_outputs = constant_outputs(
                made, self.trace, tensors, self.differentiated
            )
        # ``fn`` may return a tensor it reached (``return self.w``): the Function's view.
        out_leaves = [
            table.get(id(x), x) if isinstance(x, torch.Tensor) else x for x in out_leaves
        ]
        positions = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        if self.out_treedef is None:
            check_outputs_visible(out_leaves, self.region.label)
            # Keep the structure and dtypes only: an output of the recorded forward
            # is a wrapper of its inner ``vjp`` level, whose graph would keep every
            # activation of the region alive as long as this call lives.
            with _below_all_levels():
                stand_ins = [
                    torch.empty(0, dtype=x.dtype, device="meta")
                    if isinstance(x, torch.Tensor) else x
                    for x in out_leaves
                ]
            self.out_treedef, self.out_leaves, self.out_positions = (
                out_treedef,
                stand_ins,
                positions,
            )
        elif out_treedef != self.out_treedef or positions != self.out_positions:
            raise differs(self.region.label, "its output structure", self.out_treedef, out_treedef)
        return tuple(out_leaves[i] for i in positions)

    def run_as_differentiated(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run ``fn`` as the backward's ``vjp`` will, so both see the same aten ops."""
        return run_as_differentiated(self, tensors)

    def unflatten_output(self, flat: Sequence[torch.Tensor]) -> Any:
        if self.views is not None and self.views.views:
            flat = self.views.remade(flat)
        leaves = list(self.out_leaves)
        for position, tensor in zip(self.out_positions, flat, strict=True):
            leaves[position] = tensor
        return optree.tree_unflatten(self.out_treedef, leaves)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The region's forward: record what the policy keeps, guard against hidden inputs."""
        if self.region.preserve_rng_state:
            found = generators_of(self.user_fn, self.leaves, self.walk)
            self.rng = RngState.capture(tensors, found)
        # The guard checks each op as `_Substitution` hands it over (one mode, not two).
        self.guard = _HiddenInputGuard(self, tensors)
        try:
            policy = self.region.policy
            with _Births(self.guard), self.watch(tensors), self.autocast_watch():
                # Without the determinism check a demoted held region's recompute
                # would run unchecked: record, so that the replay checks its shapes.
                if self.region.determinism_check and may_hold(policy, self):
                    self.held = HeldGraph()
                    become_latest(self.held)
                    out = run_as_differentiated(self, tensors, self.held)
                elif not policy.needs_op_trace and not policy.saves_latest_region:
                    # Under autocast torch.func's levels cast otherwise than plain
                    # autograd: the forward runs as the backward's ``vjp`` will.
                    plain = not self.autocast.enabled
                    out = self.run(tensors) if plain else self.run_as_differentiated(tensors)
                else:
                    self.log = _new_log(self.region, tensors)
                    with RecordMode(self.log):
                        out = self.run_as_differentiated(tensors)
                    check_names(self.log.policy, self.region.label, self.log.names_seen)
                    # A memory budget plans its first call here (NOTE [ Budget plans ]).
                    settle(self.log, None, tensors)
        finally:
            self.guard = None
        self.rng_after = self.rng.now() if self.rng is not None else None
        out, escaped = self.escapes.collect(out) if self.escape_seeds else (out, ())
        if self.log is not None:  # never forward-only (NOTE [ Ops the recompute may skip ])
            self.log.note_outputs((out, escaped))
        if self.held is not None:  # their roots, while they are the forward's own tensors
            self.held.let_out(escape.target for escape in self.escapes.found)
        if self.log is not None and self.differentiable:
            # Region inputs, parameters (inputs here) and outputs are alive anyway.
            alive = (*tensors, *out, *escaped)
            # remat's own reads (storage addresses): inside an outer region's forward,
            # not calls of its function (the outer guard's hidden-input check skips them).
            with internal():
                offload_at_forward_end(self.log, self.offloaded, self.region, alive)
        if not self.transforms and not self.batched:  # eager autograd (``views.py``)
            with internal():  # remat's reads of the outputs' bases, as above
                self.views = OutputViews(out)
        # autograd.Function refuses to save an input it also returns as-is: return a view.
        given = {id(t) for t in tensors}
        return (*(t.view_as(t) if id(t) in given else t for t in out), *escaped)

    def autocast_watch(self) -> contextlib.AbstractContextManager[Any]:
        """Eager autograd only: refuse autocast entered inside ``fn``."""
        if self.transforms or self.batched:
            return contextlib.nullcontext()
        return AutocastInside(self.region.label)

    def watch(self, tensors: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[None]:
        """Note what ``fn`` may let out besides its outputs, when a backward will come."""
        if not self.escape_seeds:
            return contextlib.nullcontext()
        return self.escapes.watching([tensors[i] for i in self.escape_seeds])

    def adopt(self, twin: _Call) -> None:
        """Take the forward's records from ``twin``: a backward inside the vmap replays them."""
        self.log, self.rng, self.rng_after = twin.log, twin.rng, twin.rng_after
        self.offloaded.adopt(twin.offloaded)

    # -- lifetimes (NOTE [ The functional engine ] rule 13) -------------------------------

    def note_outputs(self, outputs: Sequence[Any]) -> None:
        """After ``apply``: the outputs as the user has them, weakly, for the backward's
        check of hooks on them (NOTE [ What the backward gives back ] rule 2)."""
        self.output_refs = note_outputs(outputs)

    def let_go_of_arguments(self) -> None:
        """After ``apply``: hold the handed-over argument tensors no more (autograd saves them)."""
        self.originals = self.arguments.let_go(self.originals)
        self.inputs, self.leaves = (), []

    def backward_ran(self, inputs: Sequence[torch.Tensor]) -> None:
        """After a backward: let the forward's records go once no backward can come again."""
        if self.backwards.ran(inputs):
            self.log = self.held = None

    def recompute(self, replay: bool) -> contextlib.AbstractContextManager[None]:
        """What the forward saw (NOTE [ The recompute context ]); replaying if ``replay``."""
        log = self.log if replay else None
        if log is not None and not any(r.holds_outputs() for r in log.records):
            # Nothing to replay (a demoted save-last region whose base policy keeps
            # nothing): the recompute runs as nothing-saveable's, checked by the trace.
            log = None
        mode = None if log is None else ReplayMode(log, check=self.region.determinism_check)
        return recompute_context(self.rng, self.autocast, mode)
