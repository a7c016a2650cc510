"""How inspection sees inside a region: frames that note what each saved tensor is.

NOTE [ How saved_residuals looks inside a region ] and NOTE [ Inspecting a
function as it is ] (in ``residuals.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

from .._compat import TorchDispatchMode, storage_address
from .._engines.eager import Frame, Holder
from .._engines.region import Region
from .._engines.save_last import separate_list
from .._replay.records import OpRecord
from .._replay.tags import TAG
from .._state import local
from ..policies import Decision
from .residual import Item, Residual

__all__ = [
    "AsIs",
    "InspectFrame",
    "SourceMode",
    "frame_items",
    "input_paths",
    "merge",
    "params",
    "traced",
    "user_frame",
]


class InspectFrame(Frame):
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


def frame_items(frame: InspectFrame, lines: dict[tuple[int, int], str]) -> list[Item]:
    """Everything the frame holds: tensors in live holders and op outputs kept in the log."""
    items: list[Item] = []
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
    frame: InspectFrame, holder: Holder, t: torch.Tensor, lines: dict[tuple[int, int], str]
) -> Item:
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


def _op_item(t: torch.Tensor, record: OpRecord, position: int, where: str) -> Item:
    decision = record.decision_at(position)
    if decision is Decision.RECOMPUTE:  # held anyway: a plain region, or the last under save_last
        decision = Decision.SAVE
    name = record.named[position][0] if record.named and position in record.named else None
    return (t, decision, name, record.op, where)


def merge(items: list[Item], base: dict[int, str]) -> list[Residual]:
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


class SourceMode(TorchDispatchMode):
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
                self.lines[tag[:2]] = user_frame()
        return out


def traced(fn: Callable[..., Any], sources: SourceMode) -> Callable[..., Any]:
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
        made = source or (func, user_frame())
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


class AsIs:
    """One as-is inspection: the frames of the regions ``fn`` runs, and plain saves outside."""

    def __init__(self, input_paths: dict[int, str], params: dict[str, torch.Tensor]) -> None:
        self.input_paths = input_paths
        self.params = params
        self.param_names = {id(t): name for name, t in params.items()}
        self.lines: dict[tuple[int, int], str] = {}
        self.frames: list[InspectFrame] = []
        #: What autograd saved outside every region, in order.
        self.saved: list[torch.Tensor] = []

    def frame(self, region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Frame:
        """The eager engine's frame for a region ``fn`` runs (called by ``run_eager``)."""
        sourced = dataclasses.replace(
            region, fn=traced(region.fn, SourceMode(self.lines)), debug=True
        )
        frame = InspectFrame(sourced, args, kwargs, self.input_paths, self.params)
        self.frames.append(frame)
        return frame

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        previous, local.inspecting = local.inspecting, self
        try:
            with (
                separate_list(),  # one save-last list, both engines: the inspection's own
                torch.enable_grad(),
                _MadeMode(),
                torch.autograd.graph.saved_tensors_hooks(self.pack, _identity),
            ):
                yield
        finally:
            local.inspecting = previous

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append(t)
        return t

    def residuals(self) -> list[Residual]:
        base: dict[int, str] = {}
        for name, t in self.params.items():
            base.setdefault(_ptr(t), f"parameter {name}")
        items = [self.plain_item(t, base) for t in self.saved]
        for frame in self.frames:
            items.extend(frame_items(frame, self.lines))
            for ptr, origin in frame.base.items():
                base.setdefault(ptr, origin)
        return merge(items, base)

    def plain_item(self, t: torch.Tensor, base: dict[int, str]) -> Item:
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
    # All of remat, not only inspection: a mode of another layer (the binding check's
    # `ForwardReads`) may sit between the user's line and the op.
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = [os.path.dirname(torch.__file__), os.path.dirname(optree.__file__), package]
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


def user_frame() -> str:
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} ({code.co_name})"


def input_paths(
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


def params(fn: Callable[..., Any]) -> dict[str, torch.Tensor]:
    region = getattr(fn, "__remat_region__", None)  # a remat.remat wrapper: its function's
    if isinstance(region, Region):
        fn = region.fn
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        return {}
    return dict([*module.named_parameters(), *module.named_buffers()])
