"""The `autograd.Function` of a call, and its rule per transform.

``forward`` (rule 1), ``backward`` (reverse levels and eager autograd, rules
3-5), ``jvp`` (forward levels, rule 3), ``vmap`` (rule 10) of NOTE [ The functional engine ] in
``__init__.py``.

NOTE [ What the backward gives back ]
1. An input no gradient reaches gets None, as in autograd without remat: a
   parameter of a skipped branch, of an expert no token was routed to, or one
   only an output the loss does not read depends on. ``torch.func.vjp`` fills
   zeros there, which AdamW's weight decay and moments would act on. So the
   backward's ``vjp`` notes, by a hook on each differentiated input, which ones
   a gradient reached, and gives None for the rest; and the Function does not
   materialize a missing output gradient as zeros. Under a torch.func
   transform torch.func itself turns None into zeros, with remat as without.
2. The outputs are siblings: outputs of one node. A hook or ``retain_grad()``
   on an output another output is computed from (``return h @ W, h``) would
   see only the gradient reaching it directly. The inputs' gradients are
   right, so nothing is looked at unless such a hook is there; then the
   backward raises (``observed.py``). Not seen, and still wrong:
   ``torch.autograd.grad(o, h)``, which never calls this backward (torch
   says ``h`` was not used, or gives None with ``allow_unused=True``).
3. An output no input's gradient flows to (``return y, h.detach()``) is marked
   non-differentiable, so it comes back with ``requires_grad=False`` as without
   remat (``constants.py``: told by the forward's ``vjp`` graph where it has one,
   by the output's maker, ``detach``, where it does not).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._compat import unwrap_if_dead
from ..._compile import uncompiled
from ..._errors import NondeterministicRecomputeError
from ..._replay.rng import check_batched_recompute
from ..escapes import EscapeWatch
from ..torch_func_refusal import torch_func_refusal
from .call import _Call
from .formulas import differ_by_grad_mode
from .levels import (
    _backward_is_differentiated,
    _differentiable,
    _forward_ad_active,
    _levels_differ,
    _recompute_mode,
)
from .observed import Observed, observed_outputs
from .roots import may_root, rooted
from .tangents import output_tangents
from .vmap import _VmapRunner, batched_twin


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
        # An output the loss does not use gets None, not zeros: a parameter only it
        # reaches then gets no gradient, as without remat (`_recompute_vjp`).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs[1:])
        ctx.save_for_forward(*inputs[1:])
        frozen = [
            t for i, t in enumerate(output)
            if not _differentiable(t) or i in call.constant_outputs
        ]
        if frozen:
            ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return uncompiled(_backward, ctx, grads)  # never compiled: see ``_compile.py``

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return uncompiled(_jvp, ctx, tangents)


def _backward(ctx: Any, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """`_RematFunction.backward`: recompute ``fn`` and take its vjp (NOTE [ The functional engine ]
    rules 3-4)."""
    call: _Call = ctx.call
    inputs: tuple[torch.Tensor, ...] = ctx.saved_tensors
    wanted = [
        i for i, t in enumerate(inputs) if ctx.needs_input_grad[i + 1] and _differentiable(t)
    ]
    if not wanted:
        return (None,) * (len(inputs) + 1)
    check_batched_recompute(call.rng, call.rng_after, call.vmap_levels, call.region.label)
    keep_graph = _backward_is_differentiated(inputs, grads)
    # The backward formulas of some ops (silu's) differ by grad mode: run them as the
    # caller's backward does (``torch.func.grad``'s under grad mode), graph or none.
    formulas = torch.is_grad_enabled()
    # A level that has exited (a vjp_fn called after its vjp returned) left dead
    # wrappers; unwrap them as functorch does for saved values of aten ops.
    inputs = tuple(unwrap_if_dead(t) for t in inputs)
    replay = not _forward_ad_active()
    found: Sequence[torch.Tensor | None] | None = None
    if replay and not keep_graph:
        found = _from_held_graph(call, inputs, wanted, grads, formulas)
    if found is None:
        restored = call.offloaded.restore() if replay else []
        observed = _observed(ctx, call, grads)
        try:
            rerun = replay and _levels_differ(keep_graph, inputs)
            mode, recomputed_from = _recompute_mode(inputs, keep_graph)
            with mode:
                found = _recompute_or_rerun(
                    call, recomputed_from, wanted, grads, (replay, rerun),
                    (keep_graph, formulas), observed,
                )
        finally:
            if replay:
                call.offloaded.drop(restored)
    call.backward_ran(inputs)  # NOTE [ The functional engine ] rule 13
    result: list[torch.Tensor | None] = [None] * len(inputs)
    for i, g in zip(wanted, found, strict=True):
        result[i] = g
    return (None, *result)

def _observed(ctx: Any, call: _Call, grads: tuple[torch.Tensor | None, ...]) -> Observed | None:
    """The check of outputs whose gradients a hook reads (rule 2), if any is."""
    seen = observed_outputs(call.output_refs, grads)
    if not seen:
        return None
    graded = [i for i, g in enumerate(grads) if g is not None]
    return Observed(call.region.label, seen, graded, len(call.out_positions))


def _from_held_graph(
    call: _Call,
    inputs: tuple[torch.Tensor, ...],
    wanted: list[int],
    grads: tuple[torch.Tensor | None, ...],
    formulas: bool,
) -> tuple[torch.Tensor | None, ...] | None:
    """The latest ``save-last`` region's gradients from its held forward graph (``held.py``),
    or None: recompute."""
    held = call.held
    if held is None or not held.held:
        return None
    # What the recompute would check first: a closed-over tensor changed in place.
    call.bindings.check_versions(call.region.label)
    retain = not call.backwards.last(inputs)
    with torch.no_grad():
        return held.backward(grads, call.differentiated, wanted, retain, formulas)


def _vmap_rule(
    info: Any, dims: tuple[int | None, ...], call: _Call, tensors: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor, ...], tuple[int | None, ...]]:
    """`_RematFunction.vmap`: the region over the batch, as one call of ``vmap(fn)``
    (NOTE [ The functional engine ] rule 10)."""
    runner = _VmapRunner(call, dims, info.batch_size, info.randomness)
    twin = batched_twin(call, tensors, runner)
    out: tuple[torch.Tensor, ...] = _RematFunction.apply(twin, *twin.inputs)  # type: ignore[no-untyped-call]
    call.adopt(twin)
    twin.let_go_of_arguments()  # NOTE [ The functional engine ] rule 13
    return out, runner.out_dims

def _jvp(ctx: Any, tangents: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """`_RematFunction.jvp`: recompute ``fn`` in full under ``torch.func.jvp``."""
    call: _Call = ctx.call
    watch = _lets_out(call)
    if watch is not None:
        # The tangents come from running ``fn`` again now, inside the user's forward:
        # what ``fn`` stores (a list entry, an attribute) would be the recompute's
        # tensor, beside or instead of the one handed back (NOTE [ Escaped tensors ] rule 7).
        raise watch.error_for_first(
            "forward mode (jvp, jacfwd, hessian) the engine runs the function again "
            "inside the forward for the tangents, which would store the recomputed "
            "tensor as well (a second list entry, an overwritten attribute)"
        )
    inputs = tuple(unwrap_if_dead(t) for t in ctx.saved_tensors)
    moving = [
        i
        for i, (t, d) in enumerate(zip(inputs, tangents[1:], strict=True))
        if d is not None and _differentiable(t)
    ]
    total = len(call.out_positions)  # no escaped tensors: refused above
    # A constant output is non-differentiable: no tangent (rule 3).
    outputs = [i for i in range(total) if _is_float(call, i) and i not in call.constant_outputs]

    # Forward-mode AD interleaves tangent ops with the primal ones: no replay. The
    # tangents come at the live level (NOTE [ Tangents at the eager dual level ]).
    with call.recompute(replay=False):
        out_tangents = output_tangents(
            _partial(call, inputs, moving, outputs),
            [inputs[i] for i in moving],
            [t for t in (tangents[i + 1] for i in moving) if t is not None],
        )
    result: list[torch.Tensor | None] = [None] * total
    for i, t in zip(outputs, out_tangents, strict=True):
        result[i] = t
    return tuple(result)

def _lets_out(call: _Call) -> EscapeWatch | None:
    """The escape watch that found tensors ``fn`` let out, if any: this call's, or, for a
    vmap twin, the call's it is for (NOTE [ Escaped tensors ] rule 6)."""
    while True:
        if call.escapes.found:
            return call.escapes
        if not isinstance(call.user_fn, _VmapRunner):
            return None
        call = call.user_fn.call

def _is_float(call: _Call, index: int) -> bool:
    if index >= len(call.out_positions):
        return True  # an escaped tensor: floating by construction
    leaf = call.out_leaves[call.out_positions[index]]
    return isinstance(leaf, torch.Tensor) and _differentiable(leaf)

def _recompute_or_rerun(
    call: _Call,
    inputs: tuple[torch.Tensor, ...],
    wanted: list[int],
    grads: tuple[torch.Tensor | None, ...],
    replay_rerun: tuple[bool, bool],
    graphs: tuple[bool, bool],
    observed: Observed | None,
) -> tuple[torch.Tensor | None, ...]:
    """`_recompute_vjp`; in full where other levels record it than the forward and
    the replay failed (``rerun``: `_levels_differ`)."""
    replay, rerun = replay_rerun
    try:
        try:
            return _recompute_vjp(call, inputs, wanted, grads, replay, graphs, observed)
        except NondeterministicRecomputeError:
            # A rerun in full is checked by the forward's torch-call trace only; with
            # ``determinism_check=False`` there is none, and a recompute that really
            # differs would give the gradient of a forward that never ran.
            if not rerun or not call.trace.enabled:
                raise
        return _recompute_vjp(call, inputs, wanted, grads, False, graphs, observed)
    except RuntimeError as error:  # what torch.func refuses, said with the region and a fix
        refusal = torch_func_refusal(
            call.region.label, error, bool(call.transforms), backward=True
        )
        if refusal is None:
            raise
        raise refusal from error

def _recompute_vjp(
    call: _Call,
    inputs: tuple[torch.Tensor, ...],
    wanted: list[int],
    grads: tuple[torch.Tensor | None, ...],
    replay: bool,
    graphs: tuple[bool, bool],
    observed: Observed | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """``graphs``: whether to keep the recompute's graph (rule 4), and the grad mode the
    caller's backward runs its formulas under (``formulas``, `_backward`)."""
    keep_graph, formulas = graphs
    outputs = [i for i, g in enumerate(grads) if g is not None and _is_float(call, i)]
    if not outputs:
        return (None,) * len(wanted)
    # Differentiate what the forward differentiated (NOTE [ The functional engine ] rule 7),
    # return what is wanted.
    moving = sorted(set(wanted) | set(call.differentiated))

    reached: set[int] = set()
    # The formulas as the caller's backward has them (``formulas.py``): a graph only
    # where one differs by grad mode, else none and the eager engine's peak.
    create = [formulas and keep_graph]
    with call.recompute(replay):
        partial = _partial(call, inputs, moving, outputs, observed)
        primal = _noting_reached(partial, moving, reached, None if create[0] or not formulas
                                 else create)
        if may_root(keep_graph):  # the recomputed outputs go once read (``roots.py``)
            primal = rooted(primal)
        vjp_fn = torch.func.vjp(primal, *(inputs[i] for i in moving))[1]
    # Called once: the recompute's graph goes as its backward consumes it, unless
    # something differentiates this backward (rule 13).
    cotangents = tuple(grads[i] for i in outputs)
    found: tuple[torch.Tensor, ...] = vjp_fn(
        cotangents, retain_graph=keep_graph, create_graph=create[0]
    )
    if create[0] and not keep_graph:  # a graph for the formulas only: it goes now
        found = tuple(t.detach() for t in found)
    # ``vjp`` gives zeros for an input no gradient reached; autograd gives None
    # (NOTE [ What the backward gives back ] rule 1).
    return tuple(found[moving.index(i)] if i in reached else None for i in wanted)


def _noting_reached(
    primal: Callable[..., tuple[torch.Tensor, ...]],
    moving: Sequence[int],
    reached: set[int],
    formulas: list[bool] | None = None,
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``primal``, noting in ``reached`` each input at ``moving`` a gradient reaches, and
    in ``formulas`` whether its graph has a formula that reads grad mode (``formulas.py``)."""

    def noted(*moved: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for i, t in zip(moving, moved, strict=True):
            t.register_hook(functools.partial(_reach, reached, i))
        out = primal(*moved)
        if formulas is not None:
            formulas[0] = differ_by_grad_mode(t.grad_fn for t in out)
        return out

    return noted


def _reach(reached: set[int], index: int, grad: torch.Tensor) -> None:
    reached.add(index)


def _partial(
    call: _Call,
    inputs: Sequence[torch.Tensor],
    moving: Sequence[int],
    outputs: Sequence[int],
    observed: Observed | None = None,
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``fn`` as a function of the inputs at ``moving``, giving the outputs at ``outputs``;
    ``observed`` checks all its outputs (rule 2)."""

    def primal(*moved: torch.Tensor) -> tuple[torch.Tensor, ...]:
        full = list(inputs)
        for i, t in zip(moving, moved, strict=True):
            full[i] = t
        out = call.escapes.run(lambda: call.run(full))
        if observed is not None:
            observed.check(out)
        return tuple(out[i] for i in outputs)

    return primal
