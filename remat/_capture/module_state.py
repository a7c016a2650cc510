"""Module state during a recompute: the forward's parameters, stateful buffers changed once.

A recompute runs ``forward`` again, reading parameters and buffers from the
modules as they are then. A `StateGuard` makes it read what the forward read:
the tensors that were in the parameter and buffer slots during the forward
(``torch.func.functional_call`` has put the module's own back by then), checked
for in-place changes since. And modules that update buffers in forward
(BatchNorm's running statistics and ``num_batches_tracked``) would update them
twice: the guard snapshots the buffers of a region's *stateful* modules when
its forward starts; while the region recomputes, each buffer is replaced by a
copy of its snapshot, and the originals are put back when the recompute ends
(also when the engine stops it early): the recompute sees the state the
forward saw, and changes nothing. The copies are made with the
recording/replay dispatch modes switched off, so the recompute runs exactly the
forward's ops. Stateful means: an instance of a registered type
(`register_stateful`; ``_NormBase``, i.e. BatchNorm/InstanceNorm/SyncBatchNorm,
is registered) or a module with the attribute ``remat_stateful = True``.

NOTE [ State the forward changes ]
No registration is needed for the common case: the guard also watches every
buffer of the other modules a region runs (and, for its recompute, the closure
cells of the region's function and the ``.grad`` of the leaves it reaches).

1. Buffers. When a module is first seen, each of its buffers up to
   `SNAPSHOT_BYTES` is copied; when the forward ends, the copies of buffers it
   did not write in place are dropped (the version counter tells), and the
   others become state, swapped in for the recompute as a stateful module's
   are (``self.seen += 1`` counts once, and the recompute reads what the
   forward read). A larger buffer written in place, or a parameter written in
   place (a decay under ``no_grad``), cannot be given back to the recompute as
   the forward found it: the recompute raises `RematError` saying so and how to
   fix it, before it computes anything. (``nn.Embedding(max_norm=...)``
   renormalizes its weight before reading it, idempotently: allowed.) A
   stateful module's parameters are snapshotted too, so ``remat_stateful =
   True`` is a fix that works.
2. Closure cells. Cells of the function holding plain Python values (a
   ``nonlocal`` counter) are read when the forward starts; while the region
   recomputes, each cell the forward (or anyone since) rebound holds its start
   value again, and gets back what it held just before the recompute after.
   Attributes, globals and containers are not restored: guard those with
   `remat.is_recomputing`.
3. Gradients. A ``.backward()`` inside the region accumulates into ``.grad``
   of leaves in the forward and would again in the recompute. The guard reads
   ``.grad`` (identity and version) of the parameters of the modules the
   region runs and of the leaf tensors its function closes over, when the
   forward starts and ends; the recompute puts back the ``.grad`` of those the
   forward changed.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm

from .._compat import (
    global_forward_pre_hooks,
    is_functorch_wrapped,
    no_dispatch_modes,
    stateful_module_types,
    storage_identity,
)
from .._compile import uncompiled
from .._errors import RematError, SavedInputMutatedError
from .._replay.checks import STANDS_FOR_LEAF
from .._state import engine_maps_slots, entered_internally, internal, local

__all__ = [
    "GuardsItsModules",
    "SNAPSHOT_BYTES",
    "StateGuard",
    "is_stateful",
    "register_stateful",
    "state_guard_of",
]

#: Buffers up to this size are copied when the forward first sees their module,
#: in case it writes them (NOTE [ State the forward changes ] rule 1).
SNAPSHOT_BYTES = 1 << 20

_STATEFUL_TYPES: list[type] = stateful_module_types()
_stateful_types = tuple(_STATEFUL_TYPES)


def register_stateful(cls: type) -> type:
    """Declare that modules of type ``cls`` update buffers or parameters in forward.

    While a rematerialized region is recomputed, the buffers and parameters of
    every stateful module it runs are swapped for copies of what the forward
    started from and restored afterwards, so state changes once per real
    forward. Buffers of up to `SNAPSHOT_BYTES` that a forward writes are
    handled without registration (NOTE [ State the forward changes ]); register
    modules that write larger buffers or their parameters in place (remat
    raises `RematError` naming them otherwise). BatchNorm (every
    ``_NormBase``) is registered already. For a single module, set
    ``module.remat_stateful = True`` instead. Usable as a class decorator.

    Args:
        cls (type): an ``nn.Module`` subclass.

    Returns:
        ``cls``, unchanged.

    Raises:
        TypeError: ``cls`` is not an ``nn.Module`` subclass.

    Examples:
        >>> import torch, remat
        >>> @remat.register_stateful
        ... class Counter(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.register_buffer("calls", torch.zeros(()))
        ...     def forward(self, x):
        ...         self.calls.add_(1)
        ...         return x.sin()
        >>> m = remat.wrap(Counter())
        >>> m(torch.ones(2, requires_grad=True)).sum().backward()
        >>> int(m.calls)
        1
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"remat.register_stateful: expected an nn.Module subclass, got {cls!r}")
    global _stateful_types
    if cls not in _STATEFUL_TYPES:
        _STATEFUL_TYPES.append(cls)
        _stateful_types = tuple(_STATEFUL_TYPES)
    return cls


def is_stateful(module: nn.Module) -> bool:
    """Whether ``module`` updates buffers in forward (registered, flagged or spectral norm)."""
    # ``__dict__``, not getattr: a module's __getattr__ raises internally when absent.
    flagged = module.__dict__.get("remat_stateful", getattr(type(module), "remat_stateful", False))
    if flagged or isinstance(module, _stateful_types):
        return True
    # The old-style spectral norm updates its power-iteration buffers in a pre-hook.
    hooks = module._forward_pre_hooks
    return bool(hooks) and any(isinstance(h, SpectralNorm) for h in hooks.values())


@dataclasses.dataclass
class _Pin:
    """A parameter or buffer slot, and the tensor in it before the forward ran the module."""

    where: str
    table: dict[str, Any]
    name: str
    tensor: torch.Tensor
    version: int
    storage: int | None
    parameter: bool


def _pins(where: str, table: dict[str, Any], parameter: bool) -> Iterator[_Pin]:
    for name, t in table.items():
        if isinstance(t, torch.Tensor):
            yield _Pin(where, table, name, t, t._version, storage_identity(t), parameter)


@dataclasses.dataclass
class _Watched:
    """A parameter or buffer slot of a module the forward runs, and what it held then.

    ``snapshot`` is a copy of the tensor's value when the module was first seen
    (buffers up to `SNAPSHOT_BYTES`, and every tensor of a stateful module), or
    None; ``version`` the tensor's version then.
    """

    where: str
    table: dict[str, Any]
    name: str
    tensor: torch.Tensor
    version: int
    snapshot: torch.Tensor | None
    parameter: bool
    #: Written in forward by design, and idempotently (``nn.Embedding(max_norm=...)``).
    exempt: bool = False

    def written(self) -> bool:
        return self.tensor._version != self.version


def _watch(
    where: str, module: nn.Module, stateful: bool, known: set[tuple[int, str, int]]
) -> list[_Watched]:
    """Watch ``module``'s parameters and buffers not in ``known``, copying what rule 1 copies.

    A stateful module's buffers are rule 2's (`_copies`); its parameters are
    copied here. Otherwise only buffers up to `SNAPSHOT_BYTES` are copied.
    """
    tables = ((True, module._parameters),) if stateful else (
        (False, module._buffers), (True, module._parameters)
    )
    new = [
        (parameter, table, name, t)
        for parameter, table in tables
        for name, t in table.items()
        if isinstance(t, torch.Tensor) and (id(table), name, id(t)) not in known
    ]
    if not new:  # the common case: a module run again with the same tensors
        return []
    # nn.Embedding(max_norm=...) renormalizes its weight before reading it: a
    # recompute renormalizes an already renormalized weight, which changes nothing.
    renorms = isinstance(module, nn.Embedding) and module.max_norm is not None
    watched = []
    # Our copies are no ops of the region (nor calls of its function).
    with no_dispatch_modes(), internal(), torch.no_grad():
        for parameter, table, name, t in new:
            known.add((id(table), name, id(t)))
            small = not parameter and t.numel() * t.element_size() <= SNAPSHOT_BYTES
            snapshot = t.detach().clone() if stateful or small else None
            watched.append(
                _Watched(
                    where, table, name, t, t._version, snapshot, parameter, parameter and renorms
                )
            )
    return watched


def _linked_copy(current: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A tensor holding ``value`` whose gradient flows to ``current`` (identity).

    The recompute of a parameter the forward wrote in place must read the value
    the forward started from, and still differentiate the slot's tensor (under
    torch.func the recompute's own graph carries the parameter's gradient).
    """
    with internal():
        if not current.requires_grad and not is_functorch_wrapped(
            current
        ):
            return value.clone()
        with torch.enable_grad():
            linked = current + (value - current).detach()
        setattr(linked, STANDS_FOR_LEAF, current.grad_fn is None)  # the recompute check
        return linked


_PLAIN_TYPES = (int, float, complex, bool, str, bytes, type(None))


def _bound(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _plain(cell: types.CellType) -> bool:
    """Whether ``cell`` holds a plain Python value (rule 2 restores those only)."""
    return _bound(cell) and type(cell.cell_contents) in _PLAIN_TYPES


def _has_grad_slot(t: Any) -> bool:
    """Whether ``t`` is a plain leaf that autograd accumulates a ``.grad`` into."""
    return (
        isinstance(t, torch.Tensor)
        and t.requires_grad
        and t.is_leaf
        and not is_functorch_wrapped(t)
    )


class _Accumulations:
    """The leaves a backward on this thread accumulates into while the forward runs (rule 3).

    A post-accumulate-grad hook per watched leaf, not a before/after comparison of
    ``.grad``: another thread training on the same parameters changes ``.grad``
    too, and the recompute must not undo its work.
    """

    def __init__(self) -> None:
        self.thread = local.thread_token
        self.handles: list[Any] = []
        self.hit: dict[int, tuple[torch.Tensor, bool]] = {}
        self.ids: set[int] = set()

    def watch(self, t: torch.Tensor) -> None:
        if id(t) in self.ids:
            return
        self.ids.add(id(t))
        started_empty = t.grad is None

        def accumulated(leaf: torch.Tensor) -> None:
            if local.thread_token is self.thread:
                self.hit.setdefault(id(leaf), (leaf, started_empty))

        self.handles.append(t.register_post_accumulate_grad_hook(accumulated))

    def close(self) -> list[tuple[torch.Tensor, bool]]:
        """Stop watching; the leaves accumulated into, with whether ``.grad`` was None."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.ids = [], set()
        hit, self.hit = list(self.hit.values()), {}
        return hit


def _closure_cells(fn: Any) -> list[types.CellType]:
    """The closure cells of ``fn`` (a function, bound method or partial) and of
    the functions it closes over, one level down (a ``nonlocal`` helper)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, types.FunctionType):
        return []
    cells = list(fn.__closure__ or ())
    known = {id(c) for c in cells}  # by identity: cells compare by their contents
    for cell in list(cells):
        inner = cell.cell_contents if _bound(cell) else None
        if isinstance(inner, types.FunctionType):
            for c in inner.__closure__ or ():
                if id(c) not in known:
                    known.add(id(c))
                    cells.append(c)
    return cells


def _closed_over_leaves(fn: Any, cells: Iterable[types.CellType]) -> list[torch.Tensor]:
    """Leaf tensors requiring grad in ``fn``'s cells, defaults and named globals (rule 3)."""
    values = [cell.cell_contents for cell in cells if _bound(cell)]
    target = getattr(fn, "__func__", fn)
    if isinstance(target, types.FunctionType):
        values.extend(target.__defaults__ or ())
        scope = target.__globals__
        values.extend(scope[name] for name in target.__code__.co_names if name in scope)
    leaves: list[torch.Tensor] = []
    for value in values:
        if _has_grad_slot(value) and all(value is not t for t in leaves):
            leaves.append(value)
    return leaves


def _unrestorable(watched: _Watched, label: str) -> RematError:
    kind = "parameter" if watched.parameter else "buffer"
    t = watched.tensor
    why = (
        "remat does not copy parameters on every forward"
        if watched.parameter
        else f"remat copies buffers of at most {SNAPSHOT_BYTES} bytes on every forward"
    )
    return RematError(
        f"remat: the forward of {label} modified {kind} '{watched.name}' of {watched.where} "
        f"(shape {tuple(t.shape)}) in place, so its recompute would start from the modified "
        f"value and modify it again ({why}). Declare the module stateful "
        "(module.remat_stateful = True, or remat.register_stateful(type(module))) so that "
        "remat copies its state when the forward starts and the recompute changes nothing; "
        "or make the update outside the rematerialized function; or use "
        "policy='everything-saveable' for this region."
    )


def _replaced(current: torch.Tensor, pin: _Pin) -> bool:
    """Whether ``current`` is another tensor than the forward's, not a view of its memory.

    A tensor subclass (FSDP's sharded DTensor parameters) cannot be compared by
    memory: its slot is left as it is.
    """
    if current is pin.tensor or pin.storage is None:
        return False
    return storage_identity(current) != pin.storage


class StateGuard:
    """Run the modules of one region call on the parameters and state their forward saw.

    Use one guard per region call, around the forward and around the recompute
    (`guarded`). During the forward it watches which modules run (a global
    forward pre-hook, present while some guard records) and, just before the
    first of a module's subtree runs, remembers the tensor in each parameter
    and buffer slot of that subtree (rule 1) and snapshots the buffers of its
    stateful modules (rule 2); the versions it checks are those the forward
    leaves. ``roots`` are pinned when the forward starts (a wrapped module,
    whose forward is called directly); ``owners`` only for their own
    parameters and buffers, and their stateful submodules are snapshotted (the
    module of a bound method, modules the function receives or closes over,
    whose children it may call as ``child.forward(x)``). In the recompute:

    1. A slot that holds another tensor than before the forward, with other
       memory, gets that tensor back while the recompute runs: a
       reparametrization that ended before backward
       (``torch.func.functional_call`` puts the module's own tensors back when
       it returns) or a forward that rebinds its own buffer does not change
       what the recompute computes. A new view of the same memory (FSDP's
       unsharded views) is left alone. A tensor modified in place after the
       forward (an optimizer step before backward, a second forward of a
       module that updates a buffer the forward did not write) raises
       `SavedInputMutatedError` instead of recomputing from the new values.
       Inside the torch.func engine this rule stands aside: that engine
       snapshots the slots (``_capture/closure.py``) and substitutes at each op
       what the forward saw, writing nothing to them.
    2. Every buffer of a stateful module is swapped for a copy of its snapshot,
       and the real buffers are put back afterwards, also when the engine stops
       the recompute early. So the recompute computes with the numbers the
       forward used (BatchNorm's cumulative-average factor depends on
       ``num_batches_tracked``) and changes no real state.
    3. What the forward wrote in place without registration (buffers, and
       refused: parameters and large buffers), the function's closure cells
       and ``.grad`` (NOTE [ State the forward changes ]) likewise: the
       recompute starts from what the forward found and leaves what it found.
    """

    def __init__(
        self,
        label: str = "the region",
        roots: Iterable[nn.Module] = (),
        owners: Iterable[nn.Module] = (),
        watch: bool = True,
        cells: Iterable[types.CellType] = (),
        leaves: Iterable[torch.Tensor] = (),
        grads: bool = True,
    ) -> None:
        self.label = label
        self.watch = watch
        self.roots = list(roots)
        self.owners = list(owners)
        self.seen: list[tuple[dict[str, Any], str, torch.Tensor]] | None = None
        self.pins: list[_Pin] | None = None
        self._pinned_ids: set[int] = set()
        self._snapshotted: set[int] = set()
        #: Slots of the modules the forward runs (NOTE [ State the forward changes ]
        #: rule 1), and after it those the forward wrote in place.
        self.watched: list[_Watched] = []
        self.written: list[_Watched] = []
        self._watch_keys: set[tuple[int, str, int]] = set()
        #: While recomputing: (id(table), name) -> the start value of every slot
        #: the recompute gets a copy in; and the copy each holds now.
        self._swaps: dict[tuple[int, str], torch.Tensor] | None = None
        self._installed: dict[tuple[int, str], torch.Tensor] = {}
        self._reswapped: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
        #: Closure cells of plain values, with their values when the forward started (rule 2).
        self.cells = list(cells)
        self.cell_start: list[tuple[types.CellType, Any]] = []
        #: Leaves whose ``.grad`` an inner backward may change (rule 3), with its
        #: state when watched; after the forward, those it changed.
        #: Whether to watch ``.grad`` at all (rule 3): not where no ``.backward()``
        #: can run inside the forward (torch refuses it under a torch.func transform),
        #: since reading ``.grad`` races with another thread training the same leaves.
        self.grads = grads
        self._grad_leaves = [t for t in leaves if _has_grad_slot(t)] if grads else []
        self.grad_watch = _Accumulations()
        #: (leaf, whether its ``.grad`` was None when the forward started).
        self.grads_written: list[tuple[torch.Tensor, bool]] = []

    def guarded(self) -> contextlib.AbstractContextManager[None]:
        """Snapshot (forward) or restore (recompute) the state around the block.

        The guard's own tensor reads (versions, ``.grad``) are remat's work, not
        calls of the region's function (`entered_internally`).
        """
        return entered_internally(self._guarded())

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        if self.pins is None:  # this call's forward (perhaps inside an outer recompute)
            yield from self._forward()
        else:
            self._refuse_unrestorable()
            with self._pinned(), self._cells_restored(), self._grads_kept():
                yield from self._swapped()

    # -- forward -------------------------------------------------------------

    def _forward(self) -> Iterator[None]:
        self.seen, self.pins = [], []
        if engine_maps_slots():  # the torch.func engine maps the slots itself: no pins
            self.pins = None
        self.cell_start = [(cell, cell.cell_contents) for cell in self.cells if _plain(cell)]
        self.grad_watch = _Accumulations()
        for t in self._grad_leaves:
            self.grad_watch.watch(t)
        for owner in self.owners:
            self._pin(type(owner).__qualname__, owner, recurse=False)
            self._snapshot_stateful(owner)  # children it may call as ``child.forward(x)``
        for root in self.roots:
            self._pin(type(root).__qualname__, root, recurse=True)
        try:
            with _watching(self) if self.watch else contextlib.nullcontext():
                yield
        except BaseException:
            self.grad_watch.close()  # no hook left on the user's leaves
            raise
        if self.pins is None:
            self.pins = []
        self._note_writes()
        # Versions as the forward left them: a module that writes its own parameter
        # in forward (``nn.Embedding(max_norm=...)``) writes it again in the recompute.
        for pin in self.pins:
            pin.version, pin.storage = pin.tensor._version, storage_identity(pin.tensor)

    def _note_writes(self) -> None:
        """Keep what the forward wrote in place (rules 1 and 3); drop the other copies."""
        written: dict[tuple[int, str], _Watched] = {}
        for w in self.watched:  # per slot, the first tensor the forward wrote
            if w.written() and not w.exempt:
                written.setdefault((id(w.table), w.name), w)
        self.written = list(written.values())
        self.watched = []
        self._watch_keys = set()
        self.grads_written = self.grad_watch.close()
        # What the recompute gets back as the forward found it is state, like a
        # stateful module's: a second forward that writes it again is no mutation.
        restored = {(id(w.table), w.name) for w in self.written if w.snapshot is not None}
        assert self.pins is not None, "this is a bug in remat, please report it"
        self.pins = [p for p in self.pins if (id(p.table), p.name) not in restored]

    def _snapshot_stateful(self, owner: nn.Module) -> None:
        for sub in owner.modules():
            if id(sub) not in self._snapshotted and is_stateful(sub):
                self._snapshotted.add(id(sub))
                assert self.seen is not None, "this is a bug in remat, please report it"
                self.seen.extend(_copies(sub))

    def saw(self, module: nn.Module) -> None:
        """The forward is about to run ``module``: pin its subtree if not pinned yet.

        A module pinned already is watched again: its slots may hold other
        tensors now (``functional_call`` inside the region). In the recompute,
        such slots get the copies again (`_reswap`).
        """
        if self._swaps is not None:
            self._reswap(module)
        elif id(module) not in self._pinned_ids:
            self._pin(type(module).__qualname__, module, recurse=True)
        else:
            self._watch(type(module).__qualname__, module, is_stateful(module))

    def _pin(self, where: str, module: nn.Module, recurse: bool) -> None:
        named = module.named_modules(remove_duplicate=False) if recurse else [("", module)]
        for prefix, sub in named:
            if id(sub) in self._pinned_ids:
                continue
            self._pinned_ids.add(id(sub))
            path = f"{where}.{prefix}" if prefix else where
            stateful = is_stateful(sub)
            self._watch(path, sub, stateful)
            if stateful and self.seen is not None and id(sub) not in self._snapshotted:
                self._snapshotted.add(id(sub))
                self.seen.extend(_copies(sub))
            if self.pins is not None:
                self.pins.extend(_pins(path, sub._parameters, parameter=True))
                if not stateful:  # stateful buffers: rule 2 instead
                    self.pins.extend(_pins(path, sub._buffers, parameter=False))

    def _watch(self, path: str, module: nn.Module, stateful: bool) -> None:
        watched = _watch(path, module, stateful, self._watch_keys)
        self.watched.extend(watched)
        for w in watched:
            if self.grads and w.parameter and _has_grad_slot(w.tensor):
                self.grad_watch.watch(w.tensor)

    # -- recompute -----------------------------------------------------------

    def _refuse_unrestorable(self) -> None:
        for watched in self.written:
            if watched.snapshot is None:
                raise _unrestorable(watched, self.label)

    @contextlib.contextmanager
    def _cells_restored(self) -> Iterator[None]:
        """Run the recompute with the cells as the forward found them (rule 2)."""
        before = [(cell, cell.cell_contents) for cell, _ in self.cell_start if _bound(cell)]
        for cell, start in self.cell_start:
            cell.cell_contents = start
        try:
            yield
        finally:
            for cell, value in before:
                cell.cell_contents = value

    @contextlib.contextmanager
    def _grads_kept(self) -> Iterator[None]:
        """Undo what the recompute's inner backward accumulates into ``.grad`` (rule 3)."""
        if not self.grads_written:
            yield
            return
        kept = []
        with no_dispatch_modes(), internal(), torch.no_grad():
            for t, started_empty in self.grads_written:
                grad = t.grad
                kept.append((t, grad, None if grad is None else grad.clone()))
                if started_empty:  # accumulate as the forward did: into nothing
                    t.grad = None
        try:
            yield
        finally:
            with no_dispatch_modes(), internal(), torch.no_grad():
                for t, grad, value in kept:
                    if grad is not None and value is not None:
                        grad.copy_(value)  # autograd accumulates in place when it can
                    t.grad = grad

    @contextlib.contextmanager
    def _pinned(self) -> Iterator[None]:
        assert self.pins is not None, "this is a bug in remat, please report it"
        if engine_maps_slots():  # the torch.func engine maps the slots itself
            yield
            return
        moved: list[tuple[_Pin, torch.Tensor]] = []
        try:
            for pin in self.pins:
                current = pin.table.get(pin.name)
                if isinstance(current, torch.Tensor) and _replaced(current, pin):
                    moved.append((pin, current))
                    pin.table[pin.name] = pin.tensor
                self._check(pin)
            yield
        finally:
            for pin, current in reversed(moved):
                pin.table[pin.name] = current

    def _check(self, pin: _Pin) -> None:
        t = pin.tensor
        same_storage = pin.storage is None or storage_identity(t) == pin.storage
        if t._version == pin.version and same_storage:
            return
        if pin.parameter:
            kind = "parameter"
            cause = "an optimizer step or a '.data' assignment before backward?"
            fix = "Call backward before modifying parameters."
        else:
            kind = "buffer"
            cause = "does the module update it in forward?"
            fix = (
                "If the module updates this buffer in forward (running statistics, a power "
                "iteration, a counter), declare it stateful: "
                "remat.register_stateful(type(module)) or module.remat_stateful = True. "
                "If your code modified it between forward and backward, modify it after "
                "backward instead."
            )
        raise SavedInputMutatedError(
            f"remat: {kind} '{pin.name}' of {pin.where} (shape {tuple(t.shape)}) was "
            f"modified in place after the forward pass of {self.label} read it (version "
            f"{t._version}, expected {pin.version}; {cause}), so its recompute would "
            f"use the new values. {fix}"
        )

    def _swapped(self) -> Iterator[None]:
        copies = [(table, name, value) for table, name, value in self.seen or []]
        copies.extend((w.table, w.name, w.snapshot) for w in self.written if w.snapshot is not None)
        if not copies:
            yield
            return
        originals = [(table, name, table[name]) for table, name, _ in copies]
        self._swaps = {(id(table), name): value for table, name, value in copies}
        try:
            for table, name, _ in copies:
                self._install(table, name)
            with _watching(self) if self.watch else contextlib.nullcontext():
                yield
        finally:
            self._swaps = None
            for table, name, replaced, copy in reversed(self._reswapped):
                if table.get(name) is copy:  # else whoever replaced it put theirs back
                    table[name] = replaced
            self._reswapped, self._installed = [], {}
            for table, name, buffer in reversed(originals):
                table[name] = buffer

    def _install(self, table: dict[str, Any], name: str) -> torch.Tensor:
        """Put a fresh copy of the slot's start value in it, for the recompute to write to."""
        assert self._swaps is not None, "this is a bug in remat, please report it"
        value = self._swaps[id(table), name]
        with no_dispatch_modes(), torch.no_grad():
            # What is differentiated keeps its gradient (a parameter; a buffer
            # passed to functional_call).
            copy = _linked_copy(table[name], value)
        table[name] = self._installed[id(table), name] = copy
        return copy

    def _reswap(self, module: nn.Module) -> None:
        """Recompute: slots given other tensors since it started get copies again."""
        assert self._swaps is not None, "this is a bug in remat, please report it"
        for table in (module._buffers, module._parameters):
            for name, current in list(table.items()):
                key = (id(table), name)
                if key in self._swaps and current is not self._installed.get(key):
                    assert isinstance(current, torch.Tensor), "this is a bug in remat"
                    self._reswapped.append((table, name, current, self._install(table, name)))


def _copies(module: nn.Module) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Snapshots of ``module``'s buffers, before its forward changes them."""
    # Outside the record/replay modes: the copies are not ops of the region.
    with no_dispatch_modes(), internal(), torch.no_grad():
        return [
            (module._buffers, name, buffer.clone())
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]


# -- watching which modules a forward runs ---------------------------------------

_hook_lock = threading.Lock()
_watchers = [0]  # guards recording, over all threads
#: Our key in torch's table of global forward pre-hooks. A fixed key, not a
#: ``RemovableHandle`` (whose ids count up from 0): torch.compile guards on the
#: table's keys, so a new handle per region call would recompile a compiled
#: module run inside a region on every call. The entry exists only while a
#: region records (a permanent global hook makes ``torch.compile(module)`` warn).
_HOOK_KEY = -7_351_117


@contextlib.contextmanager
def _watching(guard: StateGuard) -> Iterator[None]:
    """Tell ``guard`` (and every guard recording around it) about each module that runs."""
    hooks = global_forward_pre_hooks()
    with _hook_lock:
        _watchers[0] += 1
        hooks[_HOOK_KEY] = _pre_hook
    stack: list[StateGuard] = local.state_guards
    stack.append(guard)
    try:
        yield
    finally:
        stack.pop()
        with _hook_lock:
            _watchers[0] -= 1
            if not _watchers[0]:
                hooks.pop(_HOOK_KEY, None)


def _pre_hook(module: nn.Module, args: Any) -> None:
    uncompiled(_saw, module)  # a compiled module run in a region: not Dynamo's to trace


def _saw(module: nn.Module) -> None:
    with internal():
        for guard in local.state_guards:
            guard.saw(module)


class GuardsItsModules(abc.ABC):  # noqa: B024 - a marker: registered types, no methods
    """A region function that runs its modules under a `StateGuard` of its own.

    A wrapped module's forward and a `sequential` segment guard the modules they
    run; `state_guard_of` gives their region a guard that watches nothing.
    Declare one with ``@GuardsItsModules.register``.
    """


def state_guard_of(
    fn: Callable[..., Any],
    leaves: Iterable[Any] = (),
    label: str = "the region",
    grads: bool = True,
) -> StateGuard:
    """A `StateGuard` for a region's call.

    The modules it runs are found as they run; pinned from the start are
    ``fn`` itself when it is a module (its whole subtree), and the own
    parameters and buffers of the module of a bound method, of modules among
    the call's argument ``leaves`` and of modules ``fn`` closes over (which
    ``fn`` may read without calling them).

    Examples:
        >>> import torch, remat
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> guard = state_guard_of(bn)
        >>> with guard.guarded():  # not recomputing: snapshot, then the real buffers update
        ...     _ = bn(torch.randn(4, 2))
        >>> int(bn.num_batches_tracked), int(guard.seen[-1][2])
        (1, 0)
    """
    if isinstance(fn, GuardsItsModules):
        return StateGuard(label, watch=False, grads=grads)
    roots = [fn] if isinstance(fn, nn.Module) else []
    owners: list[nn.Module] = []
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        owners.append(owner)
    owners.extend(leaf for leaf in leaves if isinstance(leaf, nn.Module))
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, nn.Module):
            owners.append(value)
    cells = _closure_cells(fn)
    return StateGuard(
        label, roots, owners, cells=cells, leaves=_closed_over_leaves(fn, cells), grads=grads
    )
