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
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import statistics
import sys
import sysconfig
import time
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import policies as _policies
from .._engines.eager import Frame, Holder
from .._engines.region import Region, describe_callable
from .._replay.log import TAG, OpRecord, storage_address
from ..policies import Decision, PolicyLike
from .memory import ComputeOpCounter

__all__ = [
    "PolicyCost",
    "Residual",
    "compare",
    "format_costs",
    "format_residuals",
    "policy_costs",
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
    fn: Callable[..., Any], *args: Any, policy: PolicyLike = "nothing-saveable", **kwargs: Any
) -> list[Residual]:
    """List every tensor backward will hold for ``remat.remat(fn, policy=policy)(*args, **kwargs)``.

    Runs the forward once (eagerly, with grad enabled) and reads what the eager
    engine keeps. Under ``save_last`` the region is the most recent one, so it
    keeps everything until another ``save_last`` region runs.

    Args:
        fn (callable): the function (or module) to inspect.
        *args (Any): its positional arguments (pytrees allowed).
        policy (str | Policy | callable | list of ops, optional): the policy, in any
            form ``remat.remat`` accepts. Default: "nothing-saveable".
        **kwargs (Any): its keyword arguments.

    Returns:
        list[Residual]: one entry per distinct tensor held, in the order autograd saved them.

    Examples:
        >>> import torch
        >>> w = torch.randn(8, 8, requires_grad=True)
        >>> def f(x):
        ...     return torch.sin(x @ w).sum()
        >>> held = saved_residuals(f, torch.randn(4, 8), policy="dots-saveable")
        >>> [(r.shape, str(r.op), r.source) for r in held]  # doctest: +ELLIPSIS
        [((4, 8), 'None', 'argument x'), ((4, 8), 'aten.mm.default', '<doctest ...>:2 (f)')]
    """
    resolved = _policies.resolve(policy)
    sources = _SourceMode()

    def traced(*a: Any, **k: Any) -> Any:
        with sources:
            return fn(*a, **k)

    region = Region(fn=traced, policy=resolved, debug=True, label=describe_callable(fn))
    frame = _InspectFrame(region, args, kwargs, _input_paths(fn, args, kwargs), _params(fn))
    with torch.enable_grad():
        out = frame.run_forward()
    residuals = _held(frame, sources)
    del out  # the graph (and the holders in it) lived until the holders were read
    return residuals


def print_saved_residuals(
    fn: Callable[..., Any], *args: Any, policy: PolicyLike = "nothing-saveable", **kwargs: Any
) -> None:
    """Print what backward holds for ``fn`` under ``policy``, with totals per decision.

    Takes the same arguments as `saved_residuals`.

    Examples:
        >>> import torch
        >>> def f(x):
        ...     return torch.sin(torch.sin(x)).sum()
        >>> print_saved_residuals(f, torch.ones(4, requires_grad=True))  # doctest: +ELLIPSIS
        shape  dtype    bytes  decision  produced by  source
        (4,)   float32     16  input     -            argument x
        total: 16 B in region inputs (1 tensor); 0 B kept by the policy
    """
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
        self.plain = region.policy.keeps_everything
        self.input_paths = input_paths
        self.param_names = {id(t): name for name, t in params.items()}
        #: holder index -> where the tensor comes from, for tensors alive anyway.
        self.origins: dict[int, str] = {}
        #: storage -> where it comes from, for storages alive anyway.
        self.base: dict[int, str] = {}
        for name, t in params.items():
            self.base.setdefault(_ptr(t), f"parameter {name}")
        for t in self.inputs:
            self.base.setdefault(_ptr(t), "argument " + input_paths.get(id(t), "?"))

    def decide(self, t: torch.Tensor, holder: Holder) -> Decision:
        decision = super().decide(t, holder)
        return Decision.SAVE if self.plain else decision

    def pack(self, t: torch.Tensor) -> Holder:
        holder = super().pack(t)
        origin = None
        if id(t) in self.input_ids:
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


def _held(frame: _InspectFrame, sources: _SourceMode) -> list[Residual]:
    """Everything the frame holds: tensors in live holders and op outputs kept in the log."""
    items: list[_Item] = []
    for holder in frame.alive():  # holders autograd still references
        if isinstance(holder.tensor, torch.Tensor):
            items.append(_holder_item(frame, holder, holder.tensor, sources))
    log = frame.log
    assert log is not None, "this is a bug in remat, please report it"
    for index, record in enumerate(() if frame.plain else log.records):
        for position, t in enumerate(record.kept or ()):
            if t is not None:
                where = sources.lines.get((log.serial, index), "?")
                items.append(_op_item(t, record, position, where))
    return _merge(items, frame.base)


def _holder_item(
    frame: _InspectFrame, holder: Holder, t: torch.Tensor, sources: _SourceMode
) -> _Item:
    origin = frame.origins.get(holder.index)
    if origin is not None or holder.source is None or frame.log is None:
        return (t, "input", None, None, origin or "captured tensor")
    record, position = holder.source
    index = next(i for i, r in enumerate(frame.log.records) if r is record)
    return _op_item(t, record, position, sources.lines.get((frame.log.serial, index), "?"))


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

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.lines: dict[tuple[int, int], str] = {}

    def __torch_dispatch__(
        self, func: Any, types_: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            tag = getattr(t, TAG, None) if isinstance(t, torch.Tensor) else None
            if tag is not None and tag[:2] not in self.lines:
                self.lines[tag[:2]] = _user_frame()
        return out


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


# -- compare -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyCost:
    """What one policy costs on one call, measured by `policy_costs`.

    Attributes:
        policy (str): the policy as given (``"none"`` for no remat).
        held_bytes (int): bytes alive after the forward (held for backward, plus outputs).
        peak_bytes (int): the most bytes alive during forward and backward.
        recomputed_ops (int): aten compute ops the backward runs beyond no remat's backward.
        time_ratio (float): median step time over no remat's, measured interleaved.
    """

    policy: str
    held_bytes: int
    peak_bytes: int
    recomputed_ops: int
    time_ratio: float


def policy_costs(
    fn: Callable[..., Any],
    *args: Any,
    policies: Sequence[Any] = ("nothing-saveable", "dots-saveable", "everything-saveable"),
    repeats: int = 3,
    **kwargs: Any,
) -> list[PolicyCost]:
    """Measure memory, recompute and time of ``fn``'s forward+backward under each policy.

    The first row is always no remat (``"none"``). The loss is the sum of every
    floating-point tensor ``fn`` returns. Memory is exact on CPU (tensor storages;
    the arguments and parameters are the baseline, not counted) and comes from
    the CUDA allocator on CUDA.

    Args:
        fn (callable): the function or module.
        *args (Any): its positional arguments.
        policies (sequence, optional): policies in any form ``remat.remat`` accepts.
        repeats (int, optional): timed repetitions per policy, interleaved. Default: 3.
        **kwargs (Any): its keyword arguments.

    Returns:
        list[PolicyCost]: no remat first, then one row per policy.

    Examples:
        >>> import torch
        >>> w = torch.randn(16, 16, requires_grad=True)
        >>> rows = policy_costs(lambda x: torch.tanh(x @ w) @ w, torch.randn(4, 16),
        ...                     policies=["nothing-saveable"], repeats=1)
        >>> [r.policy for r in rows], rows[1].held_bytes < rows[0].held_bytes
        (['none', 'nothing-saveable'], True)
    """
    from .._api import remat as remat_fn
    from .memory import measure_memory

    variants = [("none", fn)] + [(_label(p), remat_fn(fn, policy=p)) for p in policies]
    steps = [(label, _loss_fn(g, kwargs)) for label, g in variants]
    memory = {label: measure_memory(step, *args) for label, step in steps}
    ops = {label: _backward_ops(step, args) for label, step in steps}
    times: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(max(1, repeats)):
        for label, step in steps:
            start = time.perf_counter()
            step(*args).backward()
            times[label].append(time.perf_counter() - start)
    base = statistics.median(times["none"])
    return [
        PolicyCost(
            label,
            memory[label].held_bytes,
            memory[label].peak_bytes,
            ops[label] - ops["none"],
            statistics.median(times[label]) / base,
        )
        for label, _ in steps
    ]


def compare(
    fn: Callable[..., Any],
    *args: Any,
    policies: Sequence[Any] = ("nothing-saveable", "dots-saveable", "everything-saveable"),
    repeats: int = 3,
    **kwargs: Any,
) -> list[PolicyCost]:
    """Print a table of what each policy costs on ``fn(*args, **kwargs)``; return its rows.

    Takes the same arguments as `policy_costs`.

    Examples:
        >>> import torch
        >>> w = torch.randn(16, 16, requires_grad=True)
        >>> rows = compare(lambda x: torch.tanh(x @ w), torch.randn(4, 16),
        ...                policies=["nothing-saveable"], repeats=1)  # doctest: +ELLIPSIS
        policy            held bytes  peak bytes  recomputed ops  time vs none
        none                     ...
    """
    rows = policy_costs(fn, *args, policies=policies, repeats=repeats, **kwargs)
    print(format_costs(rows))
    return rows


def format_costs(rows: Sequence[PolicyCost]) -> str:
    """Format `policy_costs` rows as a plain-text table.

    Examples:
        >>> print(format_costs([PolicyCost("none", 2048, 4096, 0, 1.0)]))
        policy  held bytes  peak bytes  recomputed ops  time vs none
        none         2,048       4,096               0         1.00x
    """
    header = ("policy", "held bytes", "peak bytes", "recomputed ops", "time vs none")
    cells = [header] + [
        (
            r.policy,
            f"{r.held_bytes:,}",
            f"{r.peak_bytes:,}",
            f"{r.recomputed_ops:,}",
            f"{r.time_ratio:.2f}x",
        )
        for r in rows
    ]
    return _table(cells, numeric={1, 2, 3, 4})


def _label(policy: Any) -> str:
    return policy if isinstance(policy, str) else repr(_policies.resolve(policy))


def _loss_fn(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def loss(*args: Any) -> torch.Tensor:
        leaves = optree.tree_leaves(fn(*args, **kwargs))
        floats = [t.sum() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return torch.stack(floats).sum()

    return loss


def _backward_ops(step: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> int:
    loss = step(*args)
    with ComputeOpCounter() as counter:
        loss.backward()
    return int(counter.count)
