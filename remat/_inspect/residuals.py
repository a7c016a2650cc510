"""Inspection: what a policy keeps for backward (`saved_residuals`) and what it costs (`compare`).

NOTE [ How saved_residuals looks inside a region ]
1. It builds a `Region` with ``debug=True`` (so the eager engine keeps an op log
   for every policy, even those that do not need one) and runs one eager
   `Frame`'s forward itself, exactly as ``remat.remat`` would, then reads the
   frame's holders: a holder whose ``tensor`` is set is kept for backward.
2. The frame's pack hook is wrapped to note, per holder, whether autograd saved
   a region input (found by identity, as the engine does), a parameter or a
   tensor made outside the region.
3. A `_SourceMode` entered *inside* the engine's record mode sees every op after
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
   the eager engine then builds each region's frame through `_AsIs.frame` (an
   `_InspectFrame` of the region with ``debug=True`` and its own source mode, as
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
import contextlib
import dataclasses
import inspect
import os
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import optree
import torch

from .. import policies as _policies
from .._compat import TorchDispatchMode, storage_address
from .._engines.eager import _HOOKS_REFUSED, Frame, Holder
from .._engines.region import Region, describe_callable
from .._errors import RematError
from .._replay.records import OpRecord
from .._replay.tags import TAG
from .._state import local
from ..policies import Decision, PolicyLike
from .guard import check_keywords, preserved_state

__all__ = [
    "Residual",
    "format_residuals",
    "print_saved_residuals",
    "residual_totals",
    "saved_residuals",
]

DecisionLike = Decision | Literal["input"]


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor that backward holds for a rematerialized region.

    Attributes:
        shape (tuple of int): the tensor's shape.
        dtype (torch.dtype): its dtype.
        nbytes (int): bytes of the storage it keeps alive (a view keeps its whole base).
        decision (Decision | "input"): ``Decision.SAVE`` or ``Decision.OFFLOAD`` for
            values the policy keeps; ``"input"`` for region inputs, parameters and
            tensors made outside the region, which are alive anyway.
        name (str or None): the ``checkpoint_name`` of the value, if any.
        op (OpOverload or None): the aten op that produced it (None for inputs).
        source (str): ``"file:line (function)"`` of the user code that produced it,
            or ``"argument x[0]"`` / ``"parameter fc1.weight"`` / ``"captured tensor"``.
        shared (bool): an earlier residual already holds the same storage; this
            one is not counted again in totals.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    decision: DecisionLike
    name: str | None
    op: Any
    source: str
    shared: bool = False


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
    sources = _SourceMode()
    region = Region(fn=_traced(fn, sources), policy=resolved, debug=True,
                    label=describe_callable(fn))
    frame = _InspectFrame(region, args, kwargs, _input_paths(fn, args, kwargs), _params(fn))
    with torch.enable_grad():
        out = frame.run_forward()
    residuals = _merge(_frame_items(frame, sources.lines), frame.base)
    del out  # the graph (and the holders in it) lived until the holders were read
    return residuals


def _as_is(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Residual]:
    """Inspect ``fn`` with its own regions (NOTE [ Inspecting a function as it is ])."""
    inspection = _AsIs(_input_paths(fn, args, kwargs), _params(fn))
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
        >>> r = Residual((2,), torch.float32, 8, Decision.SAVE, None, None, "f.py:1 (f)")
        >>> residual_totals([r, dataclasses.replace(r, shared=True)])
        {'input': 0, 'saved': 8, 'offloaded': 0}
    """
    totals = {"input": 0, "saved": 0, "offloaded": 0}
    for r in residuals:
        if not r.shared:
            totals[_decision_label(r.decision)] += r.nbytes
    return totals


def format_residuals(residuals: Sequence[Residual]) -> str:
    """Format residuals as `print_saved_residuals` prints them."""
    header = ("shape", "dtype", "bytes", "decision", "produced by", "source")
    rows = [header] + [_residual_row(r) for r in residuals]
    totals = residual_totals(residuals)
    counts = collections.Counter(_decision_label(r.decision) for r in residuals if not r.shared)
    kept = totals["saved"] + totals["offloaded"]
    footer = (
        f"total: {_human(totals['input'])} in region inputs ({_plural(counts['input'])}); "
        f"{_human(kept)} kept by the policy"
    )
    if kept:
        footer += (
            f" (saved {_human(totals['saved'])} in {_plural(counts['saved'])}, "
            f"offloaded {_human(totals['offloaded'])} in {_plural(counts['offloaded'])})"
        )
    return _table(rows, numeric={2}) + "\n" + footer


class _InspectFrame(Frame):
    """An eager frame that notes which saved tensors are inputs, parameters or captured."""

    def __init__(
        self,
        region: Region,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        input_paths: dict[int, str],
        params: dict[str, torch.Tensor],
    ) -> None:
        super().__init__(region, args, kwargs)
        #: The engine runs such a policy as plain autograd (no op log): everything saved.
        self.plain = region.policy.recomputes_nothing
        self.input_paths = input_paths
        self.param_names = {id(t): name for name, t in params.items()}
        #: holder index -> where the tensor comes from, for tensors alive anyway.
        self.origins: dict[int, str] = {}
        #: storage -> where it comes from, for storages alive anyway.
        self.base: dict[int, str] = {}
        for name, t in params.items():
            self.base.setdefault(_ptr(t), f"parameter {name}")
        #: holder index -> (op, source) of an input made during an as-is inspection.
        self.made: dict[int, tuple[Any, str]] = {}
        for t in self.inputs:
            if getattr(t, _MADE, None) is None:
                self.base.setdefault(_ptr(t), "argument " + input_paths.get(id(t), "?"))

    def decision_for(self, t: torch.Tensor, holder: Holder) -> Decision:
        decision = super().decision_for(t, holder)
        return Decision.SAVE if self.plain else decision

    def pack(self, t: torch.Tensor) -> Holder:
        holder = super().pack(t)
        origin = None
        made = _made_here(t)
        if made is not None and not holder.owned:
            self.made[holder.index] = made  # held only for this region (NOTE [ ... as it is ] 2)
        elif id(t) in self.input_ids:
            origin = "argument " + self.input_paths.get(id(t), "?")
        elif t.is_leaf and t.requires_grad:
            name = self.param_names.get(id(t))
            origin = f"parameter {name}" if name else "captured tensor"
        if origin is not None:
            self.origins[holder.index] = origin
            self.base.setdefault(_ptr(t), origin)
        return holder


#: What one held tensor is, before duplicates are merged: (tensor, decision, name, op, source).
_Item = tuple[torch.Tensor, DecisionLike, str | None, Any, str]


def _frame_items(frame: _InspectFrame, lines: dict[tuple[int, int], str]) -> list[_Item]:
    """Everything the frame holds: tensors in live holders and op outputs kept in the log."""
    items: list[_Item] = []
    for holder in frame.alive():  # holders autograd still references
        if isinstance(holder.tensor, torch.Tensor):
            items.append(_holder_item(frame, holder, holder.tensor, lines))
    log = frame.log
    assert log is not None, "this is a bug in remat, please report it"
    for index, record in enumerate(() if frame.plain else log.records):
        for position, t in enumerate(record.kept or ()):
            if t is not None:
                where = lines.get((log.serial, index), "?")
                items.append(_op_item(t, record, position, where))
    return items


def _holder_item(
    frame: _InspectFrame, holder: Holder, t: torch.Tensor, lines: dict[tuple[int, int], str]
) -> _Item:
    made = frame.made.get(holder.index)
    if made is not None:
        op, where = made
        return (t, Decision.SAVE, None, op, f"{where}, an input of {_short(frame.region.label)}")
    origin = frame.origins.get(holder.index)
    if origin is not None or holder.source is None or frame.log is None:
        return (t, "input", None, None, origin or "captured tensor")
    record, position = holder.source
    index = next(i for i, r in enumerate(frame.log.records) if r is record)
    return _op_item(t, record, position, lines.get((frame.log.serial, index), "?"))


def _short(label: str) -> str:
    """A region's label without its file: "Block.forward" of "Block.forward (/a/b.py:3)"."""
    return label.split(" (", 1)[0]


def _op_item(t: torch.Tensor, record: OpRecord, position: int, where: str) -> _Item:
    decision = record.decision_at(position)
    if decision is Decision.RECOMPUTE:  # held anyway: a plain region, or the last under save_last
        decision = Decision.SAVE
    name = record.named[position][0] if record.named and position in record.named else None
    return (t, decision, name, record.op, where)


def _merge(items: list[_Item], base: dict[int, str]) -> list[Residual]:
    """One residual per distinct tensor; views of inputs are inputs; storages counted once."""
    residuals: list[Residual] = []
    seen_tensors: set[tuple[Any, ...]] = set()
    seen_storages: set[int] = set()
    for t, decision, name, op, where in items:
        ptr = _ptr(t)
        key = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen_tensors:
            continue
        seen_tensors.add(key)
        if decision != "input" and ptr in base:
            decision, where = "input", f"{where}, a view of {base[ptr]}"
        nbytes = t.untyped_storage().nbytes()
        residuals.append(
            Residual(
                tuple(t.shape), t.dtype, nbytes, decision, name, op, where, ptr in seen_storages
            )
        )
        seen_storages.add(ptr)
    return residuals


def _ptr(t: torch.Tensor) -> int:
    # Wrapper subclasses have no data pointer; one with no inner storage is its own.
    return storage_address(t) or id(t)


class _SourceMode(TorchDispatchMode):
    """Note the user source line of every op, by the record mode's tag (NOTE rule 3)."""

    def __init__(self, lines: dict[tuple[int, int], str] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.lines: dict[tuple[int, int], str] = {} if lines is None else lines

    def __torch_dispatch__(
        self, func: Any, types_: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            tag = getattr(t, TAG, None) if isinstance(t, torch.Tensor) else None
            if tag is not None and tag[:2] not in self.lines:
                self.lines[tag[:2]] = _user_frame()
        return out


def _traced(fn: Callable[..., Any], sources: _SourceMode) -> Callable[..., Any]:
    """``fn`` run under ``sources``, entered inside the engine's record mode (NOTE rule 3)."""

    def traced(*a: Any, **k: Any) -> Any:
        with sources:
            return fn(*a, **k)

    return traced


#: Attribute set during an as-is inspection on every tensor an op returns: (op, source).
_MADE = "_remat_inspect_made"
_DETACH = torch.ops.aten.detach.default


class _MadeMode(TorchDispatchMode):
    """Tag each tensor an op returns with the op and its user line (NOTE [ ... as it is ] 2)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self, func: Any, types_: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        source = getattr(args[0], _MADE, None) if func is _DETACH and args else None
        made = source or (func, _user_frame())
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                setattr(t, _MADE, made)
        return out


def _made_here(t: torch.Tensor) -> tuple[Any, str] | None:
    """(op, source) of a tensor made during the inspected call, unless it views one made before.

    ``W.t()`` of a parameter is made in the call but holds the parameter's storage,
    which is alive anyway.
    """
    made = getattr(t, _MADE, None)
    base = t._base
    if made is None or (base is not None and getattr(base, _MADE, None) is None):
        return None
    return made  # type: ignore[no-any-return]


class _AsIs:
    """One as-is inspection: the frames of the regions ``fn`` runs, and plain saves outside."""

    def __init__(self, input_paths: dict[int, str], params: dict[str, torch.Tensor]) -> None:
        self.input_paths = input_paths
        self.params = params
        self.param_names = {id(t): name for name, t in params.items()}
        self.lines: dict[tuple[int, int], str] = {}
        self.frames: list[_InspectFrame] = []
        #: What autograd saved outside every region, in order.
        self.saved: list[torch.Tensor] = []

    def frame(self, region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Frame:
        """The eager engine's frame for a region ``fn`` runs (called by ``run_eager``)."""
        traced = dataclasses.replace(
            region, fn=_traced(region.fn, _SourceMode(self.lines)), debug=True
        )
        frame = _InspectFrame(traced, args, kwargs, self.input_paths, self.params)
        self.frames.append(frame)
        return frame

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        previous = (local.inspecting, local.last_regions)  # one save-last list, both engines
        local.inspecting, local.last_regions = self, []
        try:
            with (
                torch.enable_grad(),
                _MadeMode(),
                torch.autograd.graph.saved_tensors_hooks(self.pack, _identity),
            ):
                yield
        finally:
            local.inspecting, local.last_regions = previous

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append(t)
        return t

    def residuals(self) -> list[Residual]:
        base: dict[int, str] = {}
        for name, t in self.params.items():
            base.setdefault(_ptr(t), f"parameter {name}")
        items = [self.plain_item(t, base) for t in self.saved]
        for frame in self.frames:
            items.extend(_frame_items(frame, self.lines))
            for ptr, origin in frame.base.items():
                base.setdefault(ptr, origin)
        return _merge(items, base)

    def plain_item(self, t: torch.Tensor, base: dict[int, str]) -> _Item:
        """What autograd saved outside every region: alive anyway, or made during the call."""
        origin = None
        if id(t) in self.input_paths:
            origin = "argument " + self.input_paths[id(t)]
        elif id(t) in self.param_names:
            origin = f"parameter {self.param_names[id(t)]}"
        made = _made_here(t)
        if origin is None and made is not None:
            return (t, Decision.SAVE, None, made[0], made[1])
        origin = origin or "captured tensor"
        base.setdefault(_ptr(t), origin)
        return (t, "input", None, None, origin)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _library_dirs() -> tuple[str, ...]:
    here = os.path.dirname(os.path.abspath(__file__))
    dirs = [os.path.dirname(torch.__file__), os.path.dirname(optree.__file__), here]
    dirs.append(sysconfig.get_paths()["stdlib"])
    return tuple(os.path.join(d, "") for d in dirs)


_LIBRARY_DIRS = _library_dirs()
#: remat's own user-level code: the demo model is "user code" for inspection.
_USER_FILES_IN_REMAT = ("_demo_model.py",)


def _is_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    if os.path.basename(path) in _USER_FILES_IN_REMAT:
        return False
    return path.startswith(_LIBRARY_DIRS) or filename.startswith("<frozen")


def _user_frame() -> str:
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} ({code.co_name})"


def _input_paths(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[int, str]:
    """Map id(tensor) -> "x[0]['w']" for every tensor in the call's arguments."""
    try:
        target = type(fn).forward if isinstance(fn, torch.nn.Module) else fn
        bound = inspect.signature(target).bind(
            *((fn, *args) if isinstance(fn, torch.nn.Module) else args), **kwargs
        )
        named = dict(bound.arguments)
        named.pop("self", None) if isinstance(fn, torch.nn.Module) else None
    except (TypeError, ValueError):
        named = {f"args[{i}]": a for i, a in enumerate(args)} | kwargs
    paths: dict[int, str] = {}
    for arg_name, value in named.items():
        leaves_paths = optree.tree_flatten_with_path(value, none_is_leaf=True)
        for path, leaf in zip(leaves_paths[0], leaves_paths[1], strict=True):
            if isinstance(leaf, torch.Tensor):
                paths.setdefault(id(leaf), arg_name + "".join(f"[{p!r}]" for p in path))
    return paths


def _params(fn: Callable[..., Any]) -> dict[str, torch.Tensor]:
    region = getattr(fn, "__remat_region__", None)  # a remat.remat wrapper: its function's
    if isinstance(region, Region):
        fn = region.fn
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        return {}
    return dict([*module.named_parameters(), *module.named_buffers()])


def _decision_label(decision: DecisionLike) -> str:
    if decision == "input":
        return "input"
    return "offloaded" if decision is Decision.OFFLOAD else "saved"


def _residual_row(r: Residual) -> tuple[str, ...]:
    op = r.op.overloadpacket.__name__ if r.op is not None else "-"
    produced = f"{r.name!r} ({op})" if r.name is not None else op
    nbytes = f"{r.nbytes:,}" + (" (shared)" if r.shared else "")
    dtype = str(r.dtype).removeprefix("torch.")
    return (str(r.shape), dtype, nbytes, _decision_label(r.decision), produced, r.source)


def _table(rows: Sequence[Sequence[str]], numeric: set[int]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            c.rjust(w) if i in numeric and row is not rows[0] else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def _plural(n: int) -> str:
    return f"{n} tensor" if n == 1 else f"{n} tensors"
