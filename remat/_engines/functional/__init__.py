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
   autograd (a fully unwrapped input or cotangent that requires grad, while
   grad mode is on: ``loss.backward()`` runs the backward without it).
   Forward-mode levels still see the ops under ``no_grad``.
5. What keeps savings. Memory: ``grad``, ``vjp``, ``jacrev``, ``vmap`` of those,
   and eager backward through ``vmap`` drop the recompute graph (rule 4); the
   higher-order reverse compositions (``grad(grad)``, ``jacrev(jacrev)``,
   ``create_graph``) keep it, as they must. Compute: policy-saved ops are
   replayed, not rerun, in every composition without a forward-mode level
   (rule 3); under ``jvp``, ``jacfwd`` and ``hessian`` the region is recomputed
   in full. ``OFFLOAD`` decisions go to the host store where replay is used
   (rule 8), and stay on the device under a forward-mode level.
6. ``save_last`` (NOTE [ The save-last chain ] in ``_engines/save_last.py``): the
   most recent region holds its forward's graph (`HeldGraph`, ``held.py``): its
   forward runs ``fn`` under ``torch.func.vjp`` anyway (rule 7), that graph holds
   what autograd saves and no more, and its backward differentiates it from its
   roots without running ``fn`` again. Only under one reverse level and nothing
   else, for ``save-last`` itself (`may_hold`); elsewhere (``save-last+P``, vmap,
   forward mode, higher order) it records every output (`_SaveAllWhileLatest`).
   When the next ``save_last`` region of either engine starts its forward, this
   one releases what its base policy would not have kept (the held graph: all
   of it; its backward then recomputes).
7. Same ops in forward and recompute. Composite ops decompose by whether their
   inputs require grad (``linear``/``matmul`` on 3-D inputs fold to ``mm`` in
   one case and not in the other), and the forward runs with its inputs
   unwrapped. So a recorded forward runs ``fn`` under ``torch.func.vjp`` with
   respect to the inputs some level differentiates, and the backward's ``vjp``
   differentiates the same inputs: both see the same physical ops, which replay
   and its determinism check need. Both run under grad mode (CPU ``nn.LSTM``'s
   kernel keeps what its backward needs only then); a backward's recompute
   that nothing differentiates detaches its plain inputs, so eager autograd
   does not record it (rule 4). Autograd saves a ``clone`` of what an in-place
   op overwrites once per recording level (``gru_cell``'s ``mul_``): where the
   levels recording the forward and the recompute may differ (eager autograd
   recorded a forward whose parameters require grad; a differentiated
   backward) a replay that fails is run again in full (`_levels_differ`,
   `_recompute_or_rerun`), still checked against the forward's torch calls.
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
13. Lifetimes: the eager engine's floor. A call holds no more than its backward
   needs, for no longer. After ``apply`` it lets go of the tensor arguments it
   handed over (`Arguments.let_go`; a `Released` stand-in keeps each one's place
   in the substitution table), so only autograd's saved inputs keep them, and a
   backward that does not keep its graph (``torch.func.grad``'s own,
   ``retain_graph=False``) frees each region's inputs once it has run, as the
   eager engine does. The backward's ``vjp_fn`` runs once, keeping its graph
   only where the backward is differentiated (rule 4), so the recompute's
   activations go as its backward consumes them; under reverse levels only,
   its roots are empty (``roots.py``), so the recomputed outputs go too unless
   their own graph saved them. Once the last backward that can come has run
   (`Backwards`: at most one per reverse level live at the call, and one for
   eager autograd, none keeping its graph) the forward's records go too
   (policy-saved outputs, a ``save_last`` region's everything).
   A ``vjp_fn`` keeps its graph and may be called again: it keeps them.
   Parameters passed to ``functional_call`` without ``.detach()`` require grad
   below every level, so eager autograd may differentiate the backward (rule
   4): its graph is kept, as ``torch.func.grad`` without remat keeps it.
"""

from __future__ import annotations

from typing import Any

from ..._compat import current_level
from ..region import Region
from ..torch_func_refusal import torch_func_refusal
from .arguments import _unpartial
from .call import _Call
from .function import _RematFunction
from .levels import _forward_ad_levels

__all__ = ["run_functional", "_Call"]


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
    # (A policy that recomputes nothing never comes here: NOTE [ Engine selection ] rule 2.)
    fn, args, kwargs = _unpartial(region.fn, args, kwargs)
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
    if call.held is not None:
        call.held.before_swaps(call.escapes.found)
    targets = [escape.target for escape in call.escapes.found]
    call.escapes.adopt(escaped)
    call.note_outputs([*flat_out, *targets])  # the user's tensors now (``observed.py``)
    call.let_go_of_arguments()
    return call.unflatten_output(flat_out)
