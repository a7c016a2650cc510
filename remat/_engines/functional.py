"""The torch.func engine: a region as an `autograd.Function` that functorch can transform.

Saved-tensor hooks are disabled under ``torch.func.grad``/``vjp``, so when any
functorch transform is active a region runs through `_RematFunction`, an
`autograd.Function` with ``setup_context``, its own ``vmap`` rule, a
``backward`` that recomputes ``fn`` with ``torch.func.vjp`` and a ``jvp`` that
recomputes it with ``torch.func.jvp``.

NOTE [ The functional engine ]
1. Levels. functorch calls the Function once per active transform level, from
   the innermost out; each level unwraps the inputs and lowers, so `forward`
   runs once, at the bottom, on plain tensors (under a vmap level, rule 10, it
   runs ``vmap(fn)`` on the physical batched tensors). It runs ``fn`` under `RecordMode` when
   the policy looks at ops, keeping the outputs it decides to save. `backward`
   is called by the level being differentiated, with the inputs that level saw.
2. Closed-over tensors (NOTE [ Closed-over tensors ] in ``_capture/closure.py``) become
   explicit inputs. ``fn`` runs on the user's own arguments and closure (no
   copies, no slot written: what it appends to a list stays appended, and
   another thread reading the same global sees nothing of ours); a tensor
   argument itself is passed as the Function's view, and `_Substitution` (a
   `TorchFunctionMode`, so per thread) gives each op the Function's view of
   every other tensor ``fn`` reached, by identity, in the forward and in every
   recompute. A recompute also maps slots rebound since the forward
   (`Bindings.remap`) and, for a container whose structure changed, follows the
   forward's trace of which op read which input. In the forward, a guard
   (`_HiddenInputGuard`, which `_Substitution` consults at each op) raises
   `RematError` for any tensor ``fn`` uses that the Function was not given:
   a functorch wrapper of a level that is not live inside the forward, a
   tensor that requires grad, or a tensor ``fn`` reached that got to an op
   unsubstituted. Without it such a tensor would silently get a zero gradient.
3. Replay. The record and replay modes sit below autograd and below every
   functorch layer, so every level above still records each replayed op with
   its (recomputed) inputs: replay preserves derivatives of every order. It is
   used in `backward` whenever the recompute runs the same physical ops as the
   forward, i.e. whenever no forward-mode level (``jvp``, ``jacfwd``,
   ``hessian``'s outer ``jacfwd``, eager ``forward_ad``) is active: forward-mode
   AD computes tangents op by op, which interleaves tangent ops with the primal
   ones. Then, and in `jvp` itself, the engine recomputes in full.
4. Dropping the backward's graph. ``torch.func.grad`` runs its backward with
   ``create_graph=True``, so a recompute made inside it would stay alive (a
   graph of the whole region per region) until ``grad`` returns. The backward
   therefore runs under ``no_grad`` (its inner ``vjp`` level still
   differentiates) unless something may differentiate the backward itself: a
   reverse-mode (``Grad``) level on the interpreter stack other than the one
   whose backward this is (``grad(grad)``, ``jacrev(jacrev)``), or eager
   autograd (a fully unwrapped input or cotangent that requires grad).
   Forward-mode levels still see the ops under ``no_grad``.
5. What keeps savings. Memory: ``grad``, ``vjp``, ``jacrev``, ``vmap`` of those,
   and eager backward through ``vmap`` drop the recompute graph (rule 4); the
   higher-order reverse compositions (``grad(grad)``, ``jacrev(jacrev)``,
   ``create_graph``) keep it, as they must. Compute: policy-saved ops are
   replayed, not rerun, in every composition without a forward-mode level
   (rule 3); under ``jvp``, ``jacfwd`` and ``hessian`` the region is recomputed
   in full. ``OFFLOAD`` decisions go to the host store where replay is used
   (rule 8), and stay on the device under a forward-mode level.
6. ``save_last``: the most recent region records every output; when the next
   ``save_last`` region starts its forward, the previous one releases what its
   base policy would not have kept.
7. Same ops in forward and recompute. Composite ops decompose by whether their
   inputs require grad (``linear``/``matmul`` on 3-D inputs fold to ``mm`` in
   one case and not in the other), and the forward runs with its inputs
   unwrapped. So a recorded forward runs ``fn`` under ``torch.func.vjp`` with
   respect to the inputs some level differentiates, and the backward's ``vjp``
   differentiates the same inputs: both see the same physical ops, which replay
   and its determinism check need.
8. Offload (NOTE [ Offload: streams, events, prefetch ] in ``_offload/store.py``). At
   the end of a recorded forward, each kept output whose decision is
   ``OFFLOAD`` goes to the region's store (``Region.offload_store``, else
   `current_store`) as an `Offloaded` entry ordered (serial, op index,
   position); the record keeps a ``meta`` placeholder and drops the device
   copy; `_Call` holds the entries (not ``save_for_backward``: they are
   plain values, below every level). Kept on the device instead: what the
   store does not accept, values sharing storage with a region input, a
   parameter or a region output, values mutated since kept, ``save_last``
   regions, calls no level differentiates, calls inside a recompute, and
   calls under a forward-mode level (no replay there, rule 3). A replaying
   backward fetches the entries back into the records newest first (store
   copies run below every mode and level, `_below_all_levels`), and lets
   them go after: a later backward of the same call (a ``vjp_fn`` called
   twice) reruns those ops instead of fetching twice. Fetched values are
   plain tensors like the ones recorded, so the levels above record their
   replayed ops and ``grad(grad)`` stays exact.
9. Nested forward mode. An outer forward-mode level does not differentiate a
   custom Function's ``jvp`` rule: under two forward-mode levels (``jvp(jvp)``,
   ``jacfwd(jacfwd)``) the Function would return zero tangents of tangents. A
   region called there runs ``fn`` itself; forward mode saves nothing for a
   backward, so only a reverse level around both loses the region's savings.
10. vmap. torch's generated vmap rule runs the backward under a vmap of its
   own, where the cotangent of an output that does not depend on the batch is
   the same for every example: that output's gradient came back multiplied by
   the batch size. So `_RematFunction.vmap` (`_vmap_rule`) applies the Function
   once more, below the vmap level, to a twin call (`_Call.batched`) whose
   function is ``vmap(run)`` of the physical inputs (`_VmapRunner`): outputs not
   batched inside leave it with out dim ``None``, and the twin's backward (eager,
   or a reverse level around the vmap) differentiates ``vmap(fn)`` as a whole.
   A reverse level inside the vmap (``vmap(grad)``) calls the backward of the
   original call with batched tensors; for it the twin's forward runs
   ``vmap(vjp(fn))`` (`_Call.reversed_inside_vmap`), the order that backward
   sees, so it sees the same physical ops, and the original call replays the
   twin's records (`_Call.adopt`).
11. Containers (NOTE [ Containers remat sees into ] in ``_pytree.py``). Arguments
   and outputs are flattened by `flatten_region_io` (dataclasses, ``ModelOutput``,
   dict/list subclasses, types registered with torch's pytree); an output object
   that still holds a tensor raises `RematError` (its tensor would not be an
   output of the Function), and so does the eager engine. Argument leaves that
   are objects are walked for tensors like objects ``fn`` reaches (rule 2).
12. Escaped tensors (NOTE [ Escaped tensors ] in ``_engines/escapes.py``): a tensor
   ``fn`` hands out other than through its return value (a hook appending to
   a list, an attribute, a global) becomes an extra output of the Function,
   swapped into the user's Python object after ``apply``; the recompute
   captures it again by the number of the torch call that made it. Under the
   vmap rule (rule 10) it is found inside the vmapped run and leaves the twin as
   an extra batched output (rule 6 there).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from .._capture.closure import Bindings, find_closed_over
from .._capture.module_state import state_guard_of
from .._compat import (
    GRAD,
    JVP,
    VMAP,
    TorchDispatchMode,
    current_level,
    eager_forward_ad_level,
    functorch_disabled,
    functorch_level,
    interpreters,
    is_batched,
    is_functorch_wrapped,
    no_dispatch_modes,
    physical,
    storage_address,
    unwrap_if_dead,
    unwrap_once,
)
from .._compile import uncompiled
from .._errors import RematError
from .._offload.selection import current_store
from .._offload.store import Offloaded, next_serial, offload, placeholder_for
from .._policy.base import Decision, Policy
from .._policy.name_check import check_names
from .._pytree import check_outputs_visible, flatten_region_io
from .._replay.autocast import AutocastState
from .._replay.checks import OpTrace, divergence
from .._replay.modes import RecordMode, ReplayMode
from .._replay.records import OpLog, OpRecord
from .._replay.rng import RngState, check_batched_recompute, generators_of, vmap_levels
from .._state import internal, is_recomputing, local, recomputing
from .autograd_inside import differentiated_by, feeds, outside_grad_error
from .budget_plans import log_policy, settle
from .escapes import EscapeWatch
from .region import Region
from .torch_func_refusal import torch_func_refusal

__all__ = ["run_functional"]


def run_functional(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``region.fn(*args, **kwargs)`` so that torch.func transforms differentiate it.

    Args:
        region (Region): the function, its policy and options.
        args (tuple): positional arguments, any pytree (non-tensor leaves pass through).
        kwargs (dict): keyword arguments, any pytree.

    Returns:
        Any: what ``fn`` returns, with its tensors produced by the region's Function.

    Raises:
        RematError: ``fn`` uses a tensor the engine could not find and pass as an
            input, or the recompute differs from the forward.
    """
    fn, args, kwargs = _unpartial(region.fn, args, kwargs)
    policy = region.policy
    if policy.keeps_everything:
        return fn(*args, **kwargs)  # nothing to recompute: same graph as without remat
    if _forward_ad_levels() > 1:
        # An outer forward-mode level does not differentiate a custom Function's
        # ``jvp`` rule (functorch computes tangents of tangents as zero), so
        # ``jvp(jvp)`` and ``jacfwd(jacfwd)`` run ``fn`` itself: forward mode saves
        # nothing for a backward, only a reverse level around them loses savings.
        return fn(*args, **kwargs)
    call = _Call(region, fn, args, kwargs)
    transformed = current_level() is not None
    try:
        flat_out = _RematFunction.apply(call, *call.inputs)  # type: ignore[no-untyped-call]
    except RuntimeError as error:
        refusal = torch_func_refusal(region.label, error, transformed)
        if refusal is None:
            raise
        raise refusal from error
    # Escaped tensors come last (NOTE [ Escaped tensors ] in ``_engines/escapes.py``).
    # (`adopt` must hold the only references to them: it lets each go after its swap.)
    count = len(flat_out) - len(call.escapes.found)
    flat_out, escaped = flat_out[:count], list(flat_out[count:])
    call.escapes.adopt(escaped)
    return call.unflatten_output(flat_out)


def _handed_over(x: Any) -> bool:
    """Whether an argument is handed to ``fn`` as the Function's view (NOTE rule 2).

    A tensor, or a plain tuple holding tensors (``remat.sequential``'s activations):
    a tuple cannot be mutated, so rebuilding it loses no side effect. Lists, dicts
    and objects stay the user's own, and op substitution covers their tensors.
    """
    if isinstance(x, torch.Tensor):
        return True
    return type(x) is tuple and any(_handed_over(v) for v in x)


def _with_views(x: Any, table: dict[int, torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return table.get(id(x), x)
    if type(x) is tuple:
        return tuple(_with_views(v, table) for v in x)
    return x


def _argument_objects(leaves: Sequence[Any], label: str) -> list[tuple[Any, str]]:
    """Argument leaves that are objects no flattening sees into (NOTE rule 2)."""
    return [
        (leaf, f"argument object {type(leaf).__qualname__} of {label}")
        for leaf in leaves
        if not isinstance(leaf, (torch.Tensor, *_PLAIN_VALUES))
    ]


_PLAIN_VALUES = (str, bytes, int, float, complex, bool, torch.dtype, torch.device)


def _unpartial(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    # A partial's bound arguments cannot be swapped in place; make them call arguments.
    while isinstance(fn, functools.partial):
        args = (*fn.args, *args)
        kwargs = {**fn.keywords, **kwargs}
        fn = fn.func
    return fn, args, kwargs


# ---------------------------------------------------------------------------
# One call of a region
# ---------------------------------------------------------------------------


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
        #: The user's own arguments: ``fn`` runs on them, not on copies (NOTE rule 2).
        self.args, self.kwargs = args, kwargs
        tree: Any = (args, kwargs)
        leaves: list[Any] = flatten_region_io(tree)[0]
        self.leaves = leaves
        self.tensor_count = sum(isinstance(x, torch.Tensor) for x in leaves)
        if bindings is None:
            bindings = find_closed_over(fn, _argument_objects(leaves, region.label))
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
        #: Positions of the arguments (and keyword names) that are tensors themselves.
        self.tensor_args = [(i, x) for i, x in enumerate(args) if _handed_over(x)]
        self.tensor_kwargs = [(k, x) for k, x in kwargs.items() if _handed_over(x)]
        #: Inputs the backward will differentiate (NOTE rule 7).
        self.differentiated = [i for i, t in enumerate(self.inputs) if _tracked(t)]
        #: Whether a backward will come (of this call, or of the call a vmap twin is for).
        self.differentiable = bool(self.differentiated)
        self.out_treedef: Any = None
        self.out_leaves: list[Any] = []
        self.out_positions: list[int] = []
        self.log: OpLog | None = None
        #: Levels live where the region was called: a wrapper at one of them that
        #: ``fn`` uses inside the forward must be an input (NOTE rule 2).
        self.outer_levels = {i.level() for i in interpreters()}
        #: The transforms live at the call, (kind, level), for the vmap rule (rule 10).
        self.transforms = [(i.key(), i.level()) for i in interpreters()]
        self.guard: _HiddenInputGuard | None = None
        self.rng: RngState | None = None
        #: The generators' states when the forward ended, and its vmap levels.
        self.rng_after: RngState | None = None
        self.vmap_levels = vmap_levels()
        self.autocast = AutocastState.capture()
        #: Offloaded kept outputs (NOTE rule 8): (record, position, entry).
        self.offloaded: list[tuple[OpRecord, int, Offloaded]] = []
        #: The forward's torch calls, which every recompute must repeat (NOTE [
        #: Recompute signatures ] in ``_replay/checks.py``).
        self.trace = OpTrace(region.label, region.determinism_check)

    def run(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Call ``fn`` with ``tensors`` in place of the inputs; return its tensor outputs."""
        table = {
            id(o): t for o, t in zip(self.originals, tensors, strict=True) if o is not t
        }
        first = self.reads is None
        if not first:  # a recompute: what the forward saw, though slots were rebound since
            self.bindings.check_versions(self.region.label)
            table.update(self.bindings.remap(tensors[self.tensor_count :]))
        substitution = _Substitution(self, table, tensors)
        try:
            # The substitution outermost: the state guard's own copies (a recompute's
            # linked copy of a parameter) read the Function's views too.
            with substitution, self.state.guarded(), self.trace.watching(), \
                    _inference_mode_errors(self.region):
                out = self.fn(*self.args_with(table), **self.kwargs_with(table))
        except RuntimeError as e:
            if "wrapped->level() < level" not in str(e):
                raise
            raise self.unsubstituted_error() from e
        if first:
            self.reads = substitution.reads
            self.bindings.note_versions(substitution.used)
        out_leaves, out_treedef = flatten_region_io(out)
        # Who made each output, in the forward and in each recompute (NOTE [ Recompute
        # signatures ] rule 3).
        self.trace.outputs([x for x in out_leaves if isinstance(x, torch.Tensor)])
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
            raise divergence(
                self.region.label,
                f"it returned {out_treedef}, and the forward returned {self.out_treedef}",
            )
        return tuple(out_leaves[i] for i in positions)

    def run_as_differentiated(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run ``fn`` as the backward's ``vjp`` will, so both see the same aten ops."""
        if not self.differentiated:
            return self.run(tensors)
        kinds: list[bool] = []

        def primal(
            *moved: torch.Tensor,
        ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
            if self.guard is not None:
                self.guard.know(moved)
            self.escapes.taint(moved)
            full = list(tensors)
            for i, t in zip(self.differentiated, moved, strict=True):
                full[i] = t
            out = self.run(full)
            kinds[:] = [_differentiable(t) for t in out]
            # vjp takes floating outputs only; integer ones travel as aux.
            return (
                tuple(t for t in out if _differentiable(t)),
                tuple(t for t in out if not _differentiable(t)),
            )

        with torch.enable_grad():
            result: Any = torch.func.vjp(
                primal, *(tensors[i] for i in self.differentiated), has_aux=True
            )
        floats, others = result[0], result[2]
        it_f, it_o = iter(floats), iter(others)
        return tuple(next(it_f) if k else next(it_o) for k in kinds)

    def unsubstituted_error(self) -> RematError:
        """A transform inside ``fn`` wrapped a closed-over tensor itself (functorch's assert).

        Inside the forward the outer levels are lowered, so a transform ``fn``
        runs gets the number of one of them; wrapping a tensor of that outer
        level there fails inside functorch before any op sees it.
        """
        found = ", ".join(self.bindings.names) or "a tensor it closes over"
        return RematError(
            f"remat: {self.region.label} hands a tensor it reached without receiving it "
            f"straight to a torch.func transform run inside the region (one of: {found}); "
            "remat substitutes such tensors op by op, and a transform's own wrapping is no "
            "op. Pass that tensor itself as an argument of the rematerialized function."
        )

    def args_with(self, table: dict[int, torch.Tensor]) -> tuple[Any, ...]:
        """The user's arguments, a tensor argument itself replaced by its view.

        A tensor passed as an argument may go straight into a transform ``fn``
        runs itself (``torch.func.grad(g)(x)``), which no op substitution sees.
        Containers stay the user's own, so what ``fn`` does to them stays done.
        """
        if not self.tensor_args:
            return self.args
        args = list(self.args)
        for i, x in self.tensor_args:
            args[i] = table.get(id(x), x)
        return tuple(args)

    def kwargs_with(self, table: dict[int, torch.Tensor]) -> dict[str, Any]:
        if not self.tensor_kwargs:
            return self.kwargs
        return {**self.kwargs, **{k: _with_views(x, table) for k, x in self.tensor_kwargs}}

    def partial(
        self, inputs: Sequence[torch.Tensor], moving: Sequence[int], outputs: Sequence[int]
    ) -> Callable[..., tuple[torch.Tensor, ...]]:
        """``fn`` as a function of the inputs at ``moving``, giving the outputs at ``outputs``."""

        def primal(*moved: torch.Tensor) -> tuple[torch.Tensor, ...]:
            full = list(inputs)
            for i, t in zip(moving, moved, strict=True):
                full[i] = t
            out = self.escapes.run(lambda: self.run(full))
            return tuple(out[i] for i in outputs)

        return primal

    def unflatten_output(self, flat: Sequence[torch.Tensor]) -> Any:
        leaves = list(self.out_leaves)
        for position, tensor in zip(self.out_positions, flat, strict=True):
            leaves[position] = tensor
        return optree.tree_unflatten(self.out_treedef, leaves)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The region's forward: record what the policy keeps, guard against hidden inputs."""
        if self.region.preserve_rng_state:
            self.rng = RngState.capture(tensors, generators_of(self.user_fn, self.leaves))
        # The guard checks each op as `_Substitution` hands it over (one mode, not two).
        self.guard = _HiddenInputGuard(self, tensors)
        try:
            policy = self.region.policy
            with _Births(self.guard), self.watch(tensors):
                if not policy.needs_op_trace and not policy.keeps_last_region:
                    out = self.run(tensors)
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
        out, escaped = self.escapes.collect(out) if self.differentiated else (out, ())
        if self.log is not None:
            self.offload_kept(tensors, (*out, *escaped))
        # autograd.Function refuses to save an input it also returns as-is: return a view.
        given = {id(t) for t in tensors}
        return (*(t.view_as(t) if id(t) in given else t for t in out), *escaped)

    def watch(self, tensors: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[None]:
        """Note what ``fn`` may let out besides its outputs, when a backward will come."""
        if not self.differentiated:
            return contextlib.nullcontext()
        return self.escapes.watching([tensors[i] for i in self.differentiated])

    # -- vmap (NOTE rule 10) ---------------------------------------------------

    def batched(self, tensors: Sequence[torch.Tensor], runner: _VmapRunner) -> _Call:
        """This call over a vmap batch: ``runner`` (``vmap(fn)``) of the physical inputs."""
        twin = _Call(self.region, runner, tuple(tensors), {}, bindings=Bindings())
        twin.differentiable = twin.differentiable or self.differentiable
        # The original call's trace, inside ``runner``, checks every recompute.
        twin.trace = OpTrace(self.region.label, enabled=False)
        # And its escape watch, inside ``runner``, finds what ``fn`` lets out (NOTE
        # [ Escaped tensors ] rule 6): the twin's would see dead inner wrappers.
        twin.escapes.enabled = False
        return twin

    def reversed_inside_vmap(self) -> bool:
        """Whether a reverse level above this call's innermost vmap will call its backward.

        That backward (``vmap(grad)``) runs under the vmap with the grad level
        inside it, so the twin's forward runs ``vmap(vjp(fn))`` to see the same
        physical ops (rule 7), not ``vjp(vmap(fn))``.
        """
        vmaps = [level for kind, level in self.transforms if kind == VMAP]
        if not vmaps:
            return False
        return any(kind == GRAD and level > max(vmaps) for kind, level in self.transforms)

    def adopt(self, twin: _Call) -> None:
        """Take the forward's records from ``twin``: a backward inside the vmap replays them."""
        self.log, self.rng, self.rng_after = twin.log, twin.rng, twin.rng_after
        self.offloaded = twin.offloaded

    # -- offload (NOTE rule 8) -------------------------------------------------

    def offload_kept(self, tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
        """End of forward: move kept ``OFFLOAD`` outputs to the host store."""
        log = self.log
        assert log is not None, "this is a bug in remat, please report it"
        if (
            not self.differentiable  # no backward will come
            or is_recomputing()  # needed again at once
            or _forward_ad_active()  # the backward recomputes in full (rule 3)
            or self.region.policy.keeps_last_region
        ):
            return
        # Region inputs, parameters (inputs here) and outputs are alive anyway:
        # a value sharing storage with one of them frees nothing when moved.
        alive = {storage_address(physical(t)) for t in (*tensors, *out)}
        store = None
        serial = next_serial()
        for index, record in enumerate(log.records):
            for position, t in record.unwritten_outputs():
                if (
                    record.decision_at(position) is not Decision.OFFLOAD
                    or storage_address(t) in alive
                ):
                    continue
                if store is None:
                    store = current_store(self.region.offload_store)
                with _below_all_levels():  # the copies are ours, not the region's ops
                    entry = offload(t.detach(), store, (serial, index, position))
                    placeholder = placeholder_for(t) if entry is not None else None
                if entry is None or placeholder is None:
                    continue
                record.mark_offloaded(position, placeholder)
                self.offloaded.append((record, position, entry))

    def restore_offloaded(self) -> list[tuple[OpRecord, int]]:
        """Backward: fetch offloaded outputs back into the records, newest first."""
        restored = []
        for record, position, entry in sorted(self.offloaded, key=lambda e: e[2].seq, reverse=True):
            if not record.holds_outputs():
                continue
            with _below_all_levels():
                value = entry.get()
            record.restore(position, value)
            restored.append((record, position))
        return restored

    def drop_offloaded(self) -> None:
        """After a replayed backward: the fetched values go; a later backward reruns their ops."""
        for record, position, _ in self.offloaded:
            record.drop(position)
        self.offloaded.clear()

    @contextlib.contextmanager
    def recompute(self, replay: bool) -> Iterator[None]:
        """Restore what the forward saw (RNG, autocast), replaying kept outputs if ``replay``."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(recomputing())
            if self.rng is not None:
                stack.enter_context(self.rng.restored())
            stack.enter_context(self.autocast.applied())
            if replay and self.log is not None:
                stack.enter_context(ReplayMode(self.log, check=self.region.determinism_check))
            yield


# ---------------------------------------------------------------------------
# The Function
# ---------------------------------------------------------------------------


class _RematFunction(torch.autograd.Function):
    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return uncompiled(call.forward, tensors)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], call: _Call, *tensors: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int | None, ...]]:
        return uncompiled(_vmap_rule, info, in_dims[1:], call, tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        call = inputs[0]
        ctx.call = call
        ctx.save_for_backward(*inputs[1:])
        ctx.save_for_forward(*inputs[1:])
        frozen = [t for t in output if not _differentiable(t)]
        if frozen:
            ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return uncompiled(_backward, ctx, grads)  # never compiled: see ``_compile.py``

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return uncompiled(_jvp, ctx, tangents)


def _backward(ctx: Any, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """`_RematFunction.backward`: recompute ``fn`` and take its vjp (NOTE rules 3-4)."""
    call: _Call = ctx.call
    inputs: tuple[torch.Tensor, ...] = ctx.saved_tensors
    wanted = [
        i for i, t in enumerate(inputs) if ctx.needs_input_grad[i + 1] and _differentiable(t)
    ]
    if not wanted:
        return (None,) * (len(inputs) + 1)
    check_batched_recompute(call.rng, call.rng_after, call.vmap_levels, call.region.label)
    keep_graph = _backward_is_differentiated(inputs, grads)
    # A level that has exited (a vjp_fn called after its vjp returned) left dead
    # wrappers; unwrap them as functorch does for saved values of aten ops.
    inputs = tuple(unwrap_if_dead(t) for t in inputs)
    replay = not _forward_ad_active()
    if replay:
        call.restore_offloaded()
    try:
        with contextlib.nullcontext() if keep_graph else torch.no_grad():
            found = _recompute_vjp(call, inputs, wanted, grads, replay=replay)
    finally:
        if replay:
            call.drop_offloaded()
    result: list[torch.Tensor | None] = [None] * len(inputs)
    for i, g in zip(wanted, found, strict=True):
        result[i] = g
    return (None, *result)


def _vmap_rule(
    info: Any, dims: tuple[int | None, ...], call: _Call, tensors: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor, ...], tuple[int | None, ...]]:
    """`_RematFunction.vmap`: the region over the batch, as one call of ``vmap(fn)`` (rule 10)."""
    runner = _VmapRunner(call, dims, info.batch_size, info.randomness)
    twin = call.batched(tensors, runner)
    out: tuple[torch.Tensor, ...] = _RematFunction.apply(twin, *twin.inputs)  # type: ignore[no-untyped-call]
    call.adopt(twin)
    return out, runner.out_dims


class _VmapRunner:
    """``vmap`` of one call's ``run``; outputs that do not depend on the batch stay unbatched.

    ``torch.func.vmap`` needs its ``out_dims`` before the function runs, so the
    outputs not batched at its level leave it beside its return value, as they
    are (they belong to the levels below, which are still live), with out dim
    ``None``: no expanded copy, and no gradient summed over the batch.
    """

    def __init__(
        self, call: _Call, dims: Sequence[int | None], batch_size: int, randomness: str
    ) -> None:
        self.call = call
        self.dims = tuple(dims)
        self.batch_size = batch_size
        self.randomness = randomness
        self.out_dims: tuple[int | None, ...] = ()
        call_inside = call.reversed_inside_vmap()
        self.run = call.run_as_differentiated if call_inside else call.run
        #: The first run is the twin's forward; later ones are its recomputes.
        self.first = True
        #: Whether the region runs inside another region's run (a nested region).
        self.nested = bool(local.substitutions)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flags: list[bool] = []
        unbatched: list[torch.Tensor] = []

        def per_example(*example: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = self.run_with_escapes(example)
            level = current_level()
            flags[:] = [_batched_at(t, level) for t in out]
            unbatched[:] = [t for t, b in zip(out, flags, strict=True) if not b]
            return tuple(t for t, b in zip(out, flags, strict=True) if b)

        batched = iter(
            torch.func.vmap(per_example, in_dims=self.dims, out_dims=0, randomness=self.randomness)(
                *tensors
            )
        )
        rest = iter(unbatched)
        self.out_dims = tuple(0 if b else None for b in flags)
        return tuple(next(batched) if b else next(rest) for b in flags)

    def run_with_escapes(self, example: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """One example's outputs, then the tensors ``fn`` let out (NOTE [ Escaped
        tensors ] rule 6): found in the forward, captured again in a recompute."""
        escapes = self.call.escapes
        if not self.first:
            return escapes.run(lambda: self.run(example))
        self.first = False
        differentiated = self.call.differentiated
        if not differentiated and not self.nested:
            return self.run(example)
        # Nested, a call no level differentiates may still be differentiated by the
        # outer region's recompute: what it lets out, from any input, is loud then.
        seeds = [example[i] for i in differentiated] if differentiated else example
        with escapes.watching_calls(seeds):
            out = self.run(example)
        out, escaped = escapes.collect(out)
        if escaped and not differentiated:
            raise escapes.error_for_first(
                "it was made inside its vmap, inside another rematerialized region's run, "
                "where it cannot be handed back"
            )
        return (*out, *escaped)


def _batched_at(t: torch.Tensor, level: int | None) -> bool:
    return is_batched(t) and functorch_level(t) == level


def _jvp(ctx: Any, tangents: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """`_RematFunction.jvp`: recompute ``fn`` in full under ``torch.func.jvp``."""
    call: _Call = ctx.call
    inputs = tuple(unwrap_if_dead(t) for t in ctx.saved_tensors)
    moving = [
        i
        for i, (t, d) in enumerate(zip(inputs, tangents[1:], strict=True))
        if d is not None and _differentiable(t)
    ]
    total = len(call.out_positions) + len(call.escapes.found)
    outputs = [i for i in range(total) if _is_float(call, i)]

    # Forward-mode AD interleaves tangent ops with the primal ones: no replay.
    with call.recompute(replay=False):
        out_tangents = torch.func.jvp(
            call.partial(inputs, moving, outputs),
            tuple(inputs[i] for i in moving),
            tuple(tangents[i + 1] for i in moving),
        )[1]
    result: list[torch.Tensor | None] = [None] * total
    for i, t in zip(outputs, out_tangents, strict=True):
        result[i] = t
    return tuple(result)


def _is_float(call: _Call, index: int) -> bool:
    if index >= len(call.out_positions):
        return True  # an escaped tensor: floating by construction
    leaf = call.out_leaves[call.out_positions[index]]
    return isinstance(leaf, torch.Tensor) and _differentiable(leaf)


def _tracked(t: torch.Tensor) -> bool:
    """Whether some level (a functorch grad level or eager autograd) differentiates ``t``."""
    if not _differentiable(t):
        return False
    while True:
        if t.requires_grad:
            return True
        if not is_functorch_wrapped(t):
            return False
        t = unwrap_once(t)


def _wrapped(t: torch.Tensor) -> bool:
    return is_functorch_wrapped(t)


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _recompute_vjp(
    call: _Call,
    inputs: tuple[torch.Tensor, ...],
    wanted: list[int],
    grads: tuple[torch.Tensor | None, ...],
    replay: bool,
) -> tuple[torch.Tensor, ...]:
    outputs = [i for i, g in enumerate(grads) if g is not None and _is_float(call, i)]
    # Differentiate what the forward differentiated (NOTE rule 7), return what is wanted.
    moving = sorted(set(wanted) | set(call.differentiated))

    with call.recompute(replay):
        primal = call.partial(inputs, moving, outputs)
        vjp_fn = torch.func.vjp(primal, *(inputs[i] for i in moving))[1]
    found: tuple[torch.Tensor, ...] = vjp_fn(tuple(grads[i] for i in outputs))
    return tuple(found[moving.index(i)] for i in wanted)


# ---------------------------------------------------------------------------
# Levels: when the backward's graph can go, when replay is valid
# ---------------------------------------------------------------------------


def _backward_is_differentiated(
    inputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]
) -> bool:
    """Whether anything may differentiate this backward (NOTE rule 4).

    ``inputs`` are the saved inputs as the level being differentiated saw them
    (wrapped at that level, which may have exited already): that level is the
    highest one they carry.
    """
    own = max((functorch_level(t) for t in inputs), default=-1)
    for interpreter in interpreters():
        if interpreter.key() == GRAD and interpreter.level() != own:
            return True
    tensors = [t for t in (*inputs, *grads) if t is not None]
    return any(physical(t).requires_grad for t in tensors)


@contextlib.contextmanager
def _inference_mode_errors(region: Region) -> Iterator[None]:
    """Say what to do when ``fn`` reads a transformed tensor under ``inference_mode``.

    This engine runs ``fn`` on functorch wrappers (its backward always does, under
    ``torch.func.vjp``), and torch refuses to detach or save one inside an
    ``inference_mode`` block. ``no_grad`` computes the same constant and works.
    """
    try:
        yield
    except RuntimeError as error:
        text = str(error)
        known = ("version_counter for inference tensor", "do not track version counter")
        if isinstance(error, RematError) or not any(k in text for k in known):
            raise
        raise RematError(
            f"remat: {region.label} uses a torch.func-transformed tensor inside a "
            f"torch.inference_mode() block ({error}). The torch.func engine runs the "
            "function on transformed tensors (its backward always does, through "
            "torch.func.vjp), and torch refuses those in inference mode. Use "
            "torch.no_grad() instead of torch.inference_mode() for that block (it "
            "computes the same constant), or, for a loss.backward() outside any "
            "torch.func transform, pass engine='eager' to remat."
        ) from error


@contextlib.contextmanager
def _below_all_levels() -> Iterator[None]:
    """Plain tensor ops, seen by no dispatch mode and no functorch level (store copies)."""
    with no_dispatch_modes(), functorch_disabled(), internal():
        yield


def _forward_ad_active() -> bool:
    """Whether a forward-mode level (functorch ``jvp`` or eager ``forward_ad``) is live."""
    return _forward_ad_levels() > 0


def _forward_ad_levels() -> int:
    """How many forward-mode levels (functorch ``jvp``s, eager ``forward_ad``) are live."""
    jvps = sum(i.key() == JVP for i in interpreters())
    return jvps + int(eager_forward_ad_level() >= 0)


# ---------------------------------------------------------------------------
# Substitution: each op gets the Function's view of what ``fn`` reached (rule 2)
# ---------------------------------------------------------------------------


def _outer_views(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``tensors`` as the innermost running substitution maps them (a nested region)."""
    if not local.substitutions:
        return tensors
    table = local.substitutions[-1].table
    return tuple(table.get(id(t), t) for t in tensors)


def _flat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
    """An op's arguments as one list when none is a container (most ops), else None."""
    flat = [*args, *kwargs.values()]
    if any(isinstance(x, (list, tuple, dict)) for x in flat):
        return None
    return flat


class _Substitution(TorchFunctionMode):
    """Give each op the Function's view of each tensor ``fn`` reached (NOTE rule 2).

    ``table`` maps the ``id`` of a tensor as ``fn`` reaches it (a leaf of an
    argument, a closed-over tensor, what a rebound slot holds now) to what the
    op must get: the Function's input (unwrapped, or the inner ``vjp``'s
    wrapper) or a snapshot. A mode is per thread, and no slot is written:
    another thread reading the same tensors sees its own. The first run of a
    call (the forward) writes ``trace``: per op, which leaves were which input.
    A later run (a recompute) also gives a leaf the table does not know the
    input the forward had there, while its ops are the forward's (a list
    appended to since the forward, read as ``store[-1]``).
    """

    def __init__(
        self, call: _Call, table: dict[int, torch.Tensor], tensors: Sequence[torch.Tensor]
    ) -> None:
        super().__init__()
        self.table = table
        self.tensors = tensors
        self.replayed = call.reads
        self.reads: list[tuple[Any, tuple[tuple[int, int], ...]]] = []
        self.index = {id(o): i for i, o in enumerate(call.originals)} if call.reads is None else {}
        self.step = 0
        #: The forward's guard (NOTE rule 2), checking each op after substitution.
        self.guard = call.guard
        #: Forward: ids of the tensors ``fn`` reached that some op got (version-checked).
        self.used: set[int] = set()
        self.watched = call.reached if call.reads is None else {}
        self.call = call
        self.view_ids = {id(t) for t in table.values()}
        #: How many transforms are live where ``fn`` starts: more, and ``fn`` runs one.
        self.depth = len(interpreters())

    def lifted(self, leaf: torch.Tensor) -> None:
        """Refuse a tensor ``fn`` reached that a transform inside ``fn`` wrapped itself.

        ``torch.func.grad(g)(x, self.w)`` wraps every argument at its level, ``self.w``
        too: no op sees ``self.w`` itself, so no op can be given the Function's view
        of it, and whether that transform differentiates it cannot be told reliably
        from inside the forward (its levels are renumbered there). Substituting the
        view would drop that transform's derivative silently; keeping the original
        would drop the region's: `unsubstituted_error` says to pass it as an argument.
        """
        t = leaf
        while is_functorch_wrapped(t):
            if id(t) in self.view_ids:
                return  # a view the engine handed over (or a wrapper of one)
            t = unwrap_once(t)
            if id(t) in self.table:
                raise self.call.unsubstituted_error()

    def __enter__(self) -> _Substitution:
        super().__enter__()  # type: ignore[no-untyped-call]
        local.substitutions.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        local.substitutions.pop()
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        flat = _flat(args, kwargs)
        tree: Any = (args, kwargs)
        leaves, treedef = (flat, None) if flat is not None else optree.tree_flatten(tree)
        # remat's own work inside ``fn`` (the state guard's copies) is no op of the
        # forward's record: substituted by identity only, neither recorded nor stepped.
        ours = bool(local.internal_depth)
        expected = None if ours else self._expected(func)
        uses: list[tuple[int, int]] = []
        changed = False
        inner: bool | None = None  # whether a transform ``fn`` runs itself is live
        for j, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            if id(leaf) in self.watched:
                self.used.add(id(leaf))
            new = self.table.get(id(leaf))
            if new is None and is_functorch_wrapped(leaf):
                if inner is None:  # once per call, and only for a wrapped leaf not mapped
                    inner = len(interpreters()) > self.depth
                if inner:
                    self.lifted(leaf)
            if new is None and expected:
                i = expected.get(j)
                new = None if i is None or leaf is self.tensors[i] else self.tensors[i]
            if new is not None:
                if self.replayed is None and id(leaf) in self.index:
                    uses.append((j, self.index[id(leaf)]))
                leaves[j] = new
                changed = True
        if self.replayed is None and not ours:
            self.reads.append((func, tuple(uses)))
        new_args: Any = args
        new_kwargs: Any = kwargs
        if changed and treedef is None:  # flat: positional arguments, then keyword values
            new_args = tuple(leaves[: len(args)])
            new_kwargs = dict(zip(kwargs, leaves[len(args) :], strict=True))
        elif changed:
            assert treedef is not None, "this is a bug in remat, please report it"
            new_args, new_kwargs = optree.tree_unflatten(treedef, leaves)
        if self.guard is not None:
            return self.guard.run(func, new_args, new_kwargs, leaves)
        return func(*new_args, **new_kwargs)

    def _expected(self, func: Any) -> dict[int, int] | None:
        """In a recompute: which leaves of this op were which input in the forward."""
        if self.replayed is None:
            return None
        step, self.step = self.step, self.step + 1
        if step >= len(self.replayed):
            self.replayed = []
            return None
        then, uses = self.replayed[step]
        if then is not func and then != func:
            self.replayed = []  # the ops differ from here on: by identity only
            return None
        return dict(uses) if uses else None


# ---------------------------------------------------------------------------
# Guard against tensors the Function was not given (NOTE rule 2)
# ---------------------------------------------------------------------------


class _HiddenInputGuard:
    """Raise `RematError` when ``fn`` uses a tracked tensor that is not an input.

    Levels are numbered by depth, so inside the forward (run with the outer
    levels lowered) a level pushed there (the recorded forward's ``vjp``, a
    transform ``fn`` runs itself) gets the number of an outer one: a hidden
    wrapper of the outer level 1 looks like one of the inner level 1, and the
    inner level would treat it as its own and drop its gradient. So a wrapper
    at the number of an outer level passes only if the guard knows it: an
    input, a wrapper the engine made of an input, the output of an op run under
    the guard, or a wrapper (a transform inside ``fn``) of one of those.
    """

    def __init__(self, call: _Call, inputs: Sequence[torch.Tensor]) -> None:
        self.call = call
        self.known = {id(t) for t in inputs}
        self.inputs = list(inputs)
        #: Ids of tensors aten ops made inside the forward (filled by `_Births`).
        self.born: set[int] = set()
        self.live = {i.level() for i in interpreters()}

    def know(self, tensors: Sequence[Any]) -> None:
        self.known.update(id(t) for t in tensors if isinstance(t, torch.Tensor))

    def run(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any]
    ) -> Any:
        """Run one torch call of the forward, its tensors already substituted, checking it.

        ``leaves`` are those of ``(args, kwargs)``. Besides the hidden-input check,
        the call is offered to the recompute signature (NOTE [ Recompute signatures ]),
        its ``autograd.grad`` targets are checked, and its outputs are noted for
        escapes (NOTE [ Escaped tensors ]).
        """
        recording = self.call.trace.offer(func, args, kwargs)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and id(leaf) not in self.known:
                self.check(leaf, func)
        targets = differentiated_by(func, args, kwargs)
        for t in targets:
            self.check_grad_target(t)
        try:
            out = func(*args, **kwargs)
        except RuntimeError as error:
            if targets and "not have been used in the graph" in str(error):
                self.check_grad_result(targets, (None,) * len(targets))
            if targets and "does not require grad and does not have a grad_fn" in str(error):
                raise self.no_autograd_inside(error) from error
            raise
        if targets and isinstance(out, tuple):
            self.check_grad_result(targets, out)
        out_leaves: list[Any] = optree.tree_leaves(out, none_is_leaf=True)
        self.know(out_leaves)
        if recording is not None:
            recording.made(out_leaves)
        self.call.escapes.note(func, args, kwargs, leaves, out_leaves)
        return out

    def no_autograd_inside(self, error: RuntimeError) -> RematError:
        region = self.call.region
        return RematError(
            f"remat: {region.label} calls torch.autograd.grad on a value that does not "
            f"require grad ({error}). Under the torch.func engine, policy "
            f"{region.policy!r} runs the function's forward as an autograd.Function "
            "forward, without autograd, so nothing inside it can be differentiated "
            "there. Use policy='everything-saveable' for this region (it then runs as "
            "plain autograd)."
        )

    def _outer(self, t: torch.Tensor) -> int | None:
        """The index of the Function input that ``t`` is (or wraps), if any."""
        while True:
            for i, given in enumerate(self.inputs):
                if t is given:
                    return i
            if not is_functorch_wrapped(t):
                return None
            t = unwrap_once(t)

    def check_grad_target(self, t: torch.Tensor) -> None:
        """``torch.autograd.grad`` with respect to an input that feeds another input
        outside the region: that path is not in the Function (``_engines/autograd_inside.py``)."""
        i = self._outer(t)
        if i is None:
            return
        outer = self.call.inputs  # as given to the Function: their graph is walkable
        others = [x for j, x in enumerate(outer) if j != i]
        if feeds(outer[i], others):
            raise outside_grad_error(self.call.region.label, t)

    def check_grad_result(self, targets: list[torch.Tensor], out: tuple[Any, ...]) -> None:
        # Where the outer graph cannot be walked (a vmap level hides it), a None
        # gradient (allow_unused) for a wrapped input may be such a missing path. Loud.
        for t, g in zip(targets, out, strict=False):
            i = self._outer(t)
            if g is None and i is not None and _wrapped(self.call.inputs[i]):
                raise outside_grad_error(self.call.region.label, t)

    def check(self, t: torch.Tensor, func: Any) -> None:
        self._check_substituted(t, func)
        if is_functorch_wrapped(t):
            level = functorch_level(t)
            if level in self.call.outer_levels:
                if self._wraps_known(t):
                    self.known.add(id(t))
                    return
            else:
                if level not in self.live:  # a level pushed inside the forward
                    self.live = {i.level() for i in interpreters()}
                if level in self.live:
                    return
        elif not t.requires_grad:
            return
        name = getattr(func, "__name__", str(func))
        raise RematError(
            f"remat: {self.call.region.label} uses a tensor that is neither an argument "
            f"nor found among the tensors it closes over (shape {tuple(t.shape)}, dtype "
            f"{t.dtype}, used by {name}); under torch.func its gradient would silently "
            "be zero. remat finds tensors in the arguments (pytrees, dataclasses, dict "
            "and list subclasses, and the attributes of objects passed in), closure "
            "variables, default arguments, module parameters, attributes of objects "
            "the function reaches, and globals; not in __slots__ or in what a call "
            "returns. Pass the tensor itself as an argument, or register the type "
            "that holds it as a pytree: optree.register_pytree_node(cls, flatten_func, "
            "unflatten_func, namespace='remat')."
        )

    def _check_substituted(self, t: torch.Tensor, func: Any) -> None:
        """Raise if a tensor ``fn`` reached got to an op as itself, not as the Function's view.

        The substitution sees the tensors in an op's pytree arguments; one
        reached some other way (a transform ``fn`` runs on a closed-over tensor,
        ``torch.func.grad(g)(self.w)``, wraps it where no op sees it) would be
        differentiated outside the region.
        """
        inner = t
        while True:
            if id(inner) in self.known:  # an input itself (the forward got it unwrapped)
                return
            if id(inner) in self.call.original_ids:
                break
            if not is_functorch_wrapped(inner):
                return
            inner = unwrap_once(inner)
        index = next(i for i, o in enumerate(self.call.originals) if o is inner)
        count = self.call.tensor_count
        where = (
            f"argument tensor #{index}" if index < count
            else self.call.bindings.names[index - count]
        )
        name = getattr(func, "__name__", str(func))
        raise RematError(
            f"remat: {self.call.region.label} hands {where} to {name} in a way remat "
            "cannot substitute (inside a container it does not flatten, or straight into "
            "a torch.func transform run inside the region), so under torch.func it would "
            "be differentiated outside the region. Pass that tensor itself as an argument "
            "of the rematerialized function."
        )

    def _wraps_known(self, t: torch.Tensor) -> bool:
        while is_functorch_wrapped(t):
            t = unwrap_once(t)
            if id(t) in self.known or id(t) in self.born:
                return True
        return False


class _Births(TorchDispatchMode):
    """Note every tensor an aten op makes inside the forward (in the guard's ``born``).

    Transforms that ``fn`` runs itself (or the engine's ``vjp``) return tensors
    that no Python-level op produced (gradients from the autograd engine,
    outputs unwrapped on exit); their values were still made by aten ops inside
    the forward, unlike a hidden wrapper's, which existed before it.
    """

    def __init__(self, guard: _HiddenInputGuard) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.born = guard.born

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves: list[Any] = optree.tree_leaves(out, none_is_leaf=False)
        self.born.update(id(t) for t in leaves if isinstance(t, torch.Tensor))
        return out


# ---------------------------------------------------------------------------
# save_last (NOTE rule 6)
# ---------------------------------------------------------------------------


class _KeepAll(Policy):
    """Keep every output, remembering the base policy's verdict for the demotion."""

    uses_ops = True

    def __init__(self, base: Policy) -> None:
        self.base = base
        self.uses_names = base.uses_names

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return self.base.decide_op(op, args, kwargs) if self.base.needs_op_trace else None

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.SAVE


def _new_log(region: Region, tensors: Sequence[torch.Tensor]) -> OpLog:
    policy = region.policy
    if not policy.keeps_last_region:
        return OpLog(log_policy(region, tensors, "functional"), region.label)
    previous = local.last_functional_log() if local.last_functional_log is not None else None
    if previous is not None:
        _demote(previous)
    log = OpLog(_KeepAll(policy), region.label)
    local.last_functional_log = weakref.ref(log)
    return log


def _demote(log: OpLog) -> None:
    """Release what only being the last `save_last` region kept (the base policy decides)."""
    keeper = log.policy
    assert isinstance(keeper, _KeepAll), "this is a bug in remat, please report it"
    log.demote(keeper.base)
