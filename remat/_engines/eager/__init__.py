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
5. `save_last` (NOTE [ The save-last chain ] in ``_engines/save_last.py``): the
   latest save-last region (`Frame.holds_all_as_latest`) holds everything it
   produced, marked demotable; when a later such region that reads its outputs
   (or any torch.func-engine save-last region) starts its forward, this one is
   demoted: demotable holders are emptied and recompute armed. Regions on
   independent data, such as pipeline microbatches, each keep theirs.
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
7. Kept op outputs go once the recompute has read them: the replay releases each
   record it passes, and the recompute releases the rest of the log when it is
   done (not a recompute inside the forward: the forward goes on recording).
   What backward reads, its holders keep, each until backward consumes it. Every
   holder is full then; one that empties again (a kept tensor written in place,
   a demotion) makes a second recompute, which runs the released ops again from
   the region's inputs, with every check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._pytree import check_outputs_visible, flatten_region_io, tensor_leaves
from ..._state import local
from ..budget_plans import plain_call
from ..region import Region
from ..save_last import become_latest, mark_outputs
from .forward import Frame
from .state import (
    _HOOKS_REFUSED,
    _PLAIN_RUN,
    Holder,
    Phase,
    TorchFuncInsideError,
    _PlainRun,
    _pushed,
)

__all__ = [
    "_HOOKS_REFUSED", "Frame", "Holder", "Phase", "TorchFuncInsideError", "run_eager", "run_plain",
]


def run_eager(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``region.fn(*args, **kwargs)`` so that backward recomputes what the policy drops."""
    fn: Callable[..., Any] = region.fn
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # inference: nothing will be saved
    top = local.frames[-1] if local.frames else None
    if top is not None and top.phase is Phase.FORWARD:
        return _run_nested(top, region, args, kwargs)  # the outer region decides (rule 4)
    inspecting = local.inspecting  # NOTE [ Inspecting a function as it is ] (_inspect)
    if inspecting is None and plain_call(region, args, kwargs):
        return run_plain(region, args, kwargs)  # NOTE [ Budget plans ] rule 6
    frame = Frame(region, args, kwargs) if inspecting is None else inspecting.frame(
        region, args, kwargs
    )
    if top is not None:
        frame.parent = top  # running inside the outer region's recompute
    elif region.policy.saves_latest_region:
        become_latest(frame, frame.inputs)
    out = frame.run_forward()
    if top is None and region.policy.saves_latest_region:
        mark_outputs(frame, flatten_region_io(out)[0])
    # Autograd would differentiate a tensor in any object, but the torch.func
    # engine cannot see one in an object it cannot flatten: both raise alike.
    check_outputs_visible(flatten_region_io(out)[0], region.label)
    return out


def run_plain(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``region.fn`` as plain autograd: its policy recomputes nothing (NOTE [ Engine
    selection ] rule 2 in ``_engines/select.py``); inner regions run plainly inside it."""
    fn: Callable[..., Any] = region.fn
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    top = local.frames[-1] if local.frames else None
    if top is not None and top.phase is Phase.FORWARD:
        return _run_nested(top, region, args, kwargs)
    with _pushed(_PLAIN_RUN):
        return fn(*args, **kwargs)


def _run_nested(outer: Frame | _PlainRun, region: Region, args: Any, kwargs: Any) -> Any:
    """A region called inside another's forward runs plainly there (rule 4)."""
    out = _run_inside(outer, region.fn, args, kwargs)
    check_outputs_visible(flatten_region_io(out)[0], region.label)
    return out


def _run_inside(
    outer: Frame | _PlainRun, fn: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    log = getattr(outer, "log", None)
    if log is None:
        return fn(*args, **kwargs)
    start = len(log.records)
    out = fn(*args, **kwargs)
    log.inner_region(tensor_leaves((args, kwargs)), start)
    return out
