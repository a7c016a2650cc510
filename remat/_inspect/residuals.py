"""Inspection: what a policy keeps for backward (`saved_residuals`) and what it costs (`compare`).

NOTE [ How saved_residuals looks inside a region ]
1. It builds a `Region` with ``debug=True`` (so the eager engine keeps an op log
   for every policy, even those that do not need one) and runs one eager
   `Frame`'s forward itself, exactly as ``remat.remat`` would, then reads the
   frame's holders: a holder whose ``tensor`` is set is kept for backward.
2. The frame's pack hook is wrapped to note, per holder, whether autograd saved
   a region input (found by identity, as the engine does), a parameter or a
   tensor made outside the region.
3. A `SourceMode` entered *inside* the engine's record mode sees every op after
   the record mode tagged its outputs with (log serial, op index, position); it
   notes the first stack frame of user code (not torch, remat, optree or the
   standard library) per op. That cost is paid by inspection only.
4. Residuals that are the same tensor (same storage, offset, shape, strides)
   are listed once; a residual whose storage an earlier one already holds is
   marked ``shared`` and not counted again in totals.

NOTE [ Inspecting a function as it is ]
1. ``policy=None`` (the default, as in JAX) adds no region: ``fn`` runs as it
   is, and what it keeps is what its own regions keep plus what plain autograd
   saves outside them. While it runs, ``local.inspecting`` is set on this thread:
   the eager engine then builds each region's frame through `AsIs.frame` (an
   `InspectFrame` of the region with ``debug=True`` and its own source mode, as
   in rule 1), and the frames are read after the forward, as above.
2. Outside the regions, a saved-tensor hook notes what autograd saves, and a
   dispatch mode entered around the whole call tags every tensor an op returns
   with the op and its user source line (the regions' hooks, entered inside,
   take over within them). A tagged tensor was made during the call: when a
   region receives it as an input, it is held for backward only because that
   region needs it, so it is reported as saved (for one region around the whole
   call, the inputs are the caller's and alive anyway).
3. Regions a ``save_last`` policy demotes are this inspection's own: the thread's
   last ``save_last`` region (a real one, whose backward is still to come) is
   set aside for the call and put back after it.
4. torch.func transforms refuse to start under saved-tensor hooks, so a function
   that runs one (or a region forced onto the torch.func engine,
   ``engine="functional"``) cannot be inspected as it is: that raises
   `RematError` saying to inspect the function the transform differentiates.
5. Inspection changes no state (NOTE [ Inspection leaves the program as it
   found it ] in ``guard.py``), and checks its own keywords first.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .. import policies as _policies
from .._engines.eager import _HOOKS_REFUSED
from .._engines.region import Region, describe_callable
from .._errors import RematError
from ..policies import PolicyLike
from .frames import AsIs, InspectFrame, SourceMode, frame_items, input_paths, merge, params, traced
from .guard import check_keywords, preserved_state
from .residual import Residual, decision_label, human, plural, residual_row, table

__all__ = [
    "Residual",
    "format_residuals",
    "print_saved_residuals",
    "residual_totals",
    "saved_residuals",
]

# -- saved_residuals ---------------------------------------------------------


def saved_residuals(
    fn: Callable[..., Any], *args: Any, policy: PolicyLike | None = None, **kwargs: Any
) -> list[Residual]:
    """List every tensor backward will hold for ``fn(*args, **kwargs)``.

    Runs the forward once (eagerly, with grad enabled) and reads what autograd
    and the eager engine keep. With ``policy=None`` (the default, as in JAX) ``fn``
    is inspected as it is: a ``remat.remat``-decorated function, or a model after
    ``remat.apply``, reports what its regions keep; a plain function reports what
    plain autograd saves. With a policy, ``fn`` runs as one region under it. Under
    ``save_last`` the region is the most recent one, so it keeps everything until
    another ``save_last`` region runs. Afterwards the random generators and every
    module buffer (BatchNorm statistics) are as they were.

    Args:
        fn (callable): the function (or module) to inspect.
        *args (Any): its positional arguments (pytrees allowed).
        policy (str | Policy | callable | list of ops, optional): a policy, in any
            form ``remat.remat`` accepts, to run ``fn`` as one region under; None
            inspects ``fn`` as it is. Default: None.
        **kwargs (Any): its keyword arguments.

    Returns:
        list[Residual]: one entry per distinct tensor held, in the order autograd saved them.

    Raises:
        TypeError: a keyword argument that neither this function nor ``fn`` accepts.

    Examples:
        >>> import torch, remat
        >>> w = torch.randn(8, 8, requires_grad=True)
        >>> def f(x):
        ...     return torch.sin(x @ w).sum()
        >>> held = saved_residuals(f, torch.randn(4, 8), policy="dots-saveable")
        >>> [(r.shape, str(r.op), r.source) for r in held]  # doctest: +ELLIPSIS
        [((4, 8), 'None', 'argument x'), ((4, 8), 'aten.mm.default', '<doctest ...>:2 (f)')]
        >>> as_is = saved_residuals(remat.remat(f, policy="dots-saveable"), torch.randn(4, 8))
        >>> residual_totals(as_is) == residual_totals(held)
        True
    """
    check_keywords("remat.saved_residuals", fn, kwargs, ("policy",))
    with preserved_state(fn, args, kwargs):
        if policy is None:
            return _as_is(fn, args, kwargs)
        return _one_region(fn, policy, args, kwargs)


def _one_region(
    fn: Callable[..., Any], policy: PolicyLike, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Residual]:
    resolved = _policies.resolve(policy)
    sources = SourceMode()
    region = Region(fn=traced(fn, sources), policy=resolved, debug=True,
                    label=describe_callable(fn))
    frame = InspectFrame(region, args, kwargs, input_paths(fn, args, kwargs), params(fn))
    with torch.enable_grad():
        out = frame.run_forward()
    residuals = merge(frame_items(frame, sources.lines), frame.base)
    del out  # the graph (and the holders in it) lived until the holders were read
    return residuals


def _as_is(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Residual]:
    """Inspect ``fn`` with its own regions (NOTE [ Inspecting a function as it is ])."""
    inspection = AsIs(input_paths(fn, args, kwargs), params(fn))
    try:
        with inspection.running():
            out = fn(*args, **kwargs)
    except RuntimeError as error:
        if _HOOKS_REFUSED not in str(error) or isinstance(error, RematError):
            raise
        raise RematError(
            f"remat.saved_residuals: {describe_callable(fn)} runs a torch.func transform "
            "(grad, vjp, jacrev, ...), or a region on the torch.func engine "
            "(engine='functional'), and torch.func refuses the saved-tensor hooks that "
            "inspection reads what autograd saves with. Inspect the function the transform "
            "differentiates instead (for a region: with engine='auto', the default)."
        ) from error
    residuals = inspection.residuals()
    del out
    return residuals


def print_saved_residuals(
    fn: Callable[..., Any], *args: Any, policy: PolicyLike | None = None, **kwargs: Any
) -> None:
    """Print what backward holds for ``fn`` (under ``policy``, if given), with totals.

    Takes the same arguments as `saved_residuals`.

    Examples:
        >>> import torch, remat
        >>> def f(x):
        ...     return torch.sin(torch.sin(x)).sum()
        >>> x = torch.ones(4, requires_grad=True)
        >>> print_saved_residuals(f, x)  # doctest: +ELLIPSIS
        shape  dtype    bytes  decision  produced by  source
        (4,)   float32     16  input     -            argument x
        (4,)   float32     16  saved     sin          <doctest ...>:2 (f)
        total: 16 B in region inputs (1 tensor); 16 B kept by the policy (saved 16 B in 1 tensor...)
        >>> print_saved_residuals(remat.remat(f), x)
        shape  dtype    bytes  decision  produced by  source
        (4,)   float32     16  input     -            argument x
        total: 16 B in region inputs (1 tensor); 0 B kept by the policy
    """
    check_keywords("remat.print_saved_residuals", fn, kwargs, ("policy",))
    print(format_residuals(saved_residuals(fn, *args, policy=policy, **kwargs)))


def residual_totals(residuals: Iterable[Residual]) -> dict[str, int]:
    """Sum bytes per decision ("input", "saved", "offloaded"), each storage once.

    Examples:
        >>> import dataclasses, torch
        >>> from remat import Residual
        >>> from remat.policies import Decision
        >>> r = Residual((2,), torch.float32, 8, Decision.SAVE, None, None, "f.py:1 (f)")
        >>> residual_totals([r, dataclasses.replace(r, shared=True)])
        {'input': 0, 'saved': 8, 'offloaded': 0}
    """
    totals = {"input": 0, "saved": 0, "offloaded": 0}
    for r in residuals:
        if not r.shared:
            totals[decision_label(r.decision)] += r.nbytes
    return totals


def format_residuals(residuals: Sequence[Residual]) -> str:
    """Format residuals as `print_saved_residuals` prints them."""
    header = ("shape", "dtype", "bytes", "decision", "produced by", "source")
    rows = [header] + [residual_row(r) for r in residuals]
    totals = residual_totals(residuals)
    counts = collections.Counter(decision_label(r.decision) for r in residuals if not r.shared)
    kept = totals["saved"] + totals["offloaded"]
    footer = (
        f"total: {human(totals['input'])} in region inputs ({plural(counts['input'])}); "
        f"{human(kept)} kept by the policy"
    )
    if kept:
        footer += (
            f" (saved {human(totals['saved'])} in {plural(counts['saved'])}, "
            f"offloaded {human(totals['offloaded'])} in {plural(counts['offloaded'])})"
        )
    return table(rows, numeric={2}) + "\n" + footer
