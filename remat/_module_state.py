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
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.utils._python_dispatch import _disable_current_modes

from ._compile import uncompiled
from ._errors import SavedInputMutatedError
from ._state import local

__all__ = ["StateGuard", "is_stateful", "register_stateful", "state_guard_of", "storage_of"]

_STATEFUL_TYPES: list[type] = [
    nn.modules.batchnorm._NormBase,
    nn.utils.parametrizations._SpectralNorm,  # updates its power-iteration buffers
]
_stateful_types = tuple(_STATEFUL_TYPES)


def register_stateful(cls: type) -> type:
    """Declare that modules of type ``cls`` update buffers in forward.

    While a rematerialized region is recomputed, the buffers of every stateful
    module it runs are swapped for copies and restored afterwards, so state
    changes once per real forward. BatchNorm (every ``_NormBase``) is
    registered already. For a single module, set ``module.remat_stateful = True``
    instead. Usable as a class decorator.

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
            yield _Pin(where, table, name, t, t._version, storage_of(t), parameter)


def storage_of(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (not its address: FSDP frees and refills it)."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor(t)
    if wrapped or type(t) not in (torch.Tensor, nn.Parameter):
        return None  # a tensor subclass (DTensor) or a functorch wrapper: no plain storage
    return int(t.untyped_storage()._cdata)


def _replaced(current: torch.Tensor, pin: _Pin) -> bool:
    """Whether ``current`` is another tensor than the forward's, not a view of its memory.

    A tensor subclass (FSDP's sharded DTensor parameters) cannot be compared by
    memory: its slot is left as it is.
    """
    if current is pin.tensor or pin.storage is None:
        return False
    return storage_of(current) != pin.storage


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
       non-stateful module that updates its buffer) raises
       `SavedInputMutatedError` instead of recomputing from the new values.
       Inside the torch.func engine this rule stands aside: that engine
       snapshots the slots (``_closure.py``) and substitutes at each op
       what the forward saw, writing nothing to them.
    2. Every buffer of a stateful module is swapped for a copy of its snapshot,
       and the real buffers are put back afterwards, also when the engine stops
       the recompute early. So the recompute computes with the numbers the
       forward used (BatchNorm's cumulative-average factor depends on
       ``num_batches_tracked``) and changes no real state.
    """

    def __init__(
        self,
        label: str = "the region",
        roots: Iterable[nn.Module] = (),
        owners: Iterable[nn.Module] = (),
        watch: bool = True,
    ) -> None:
        self.label = label
        self.watch = watch
        self.roots = list(roots)
        self.owners = list(owners)
        self.seen: list[tuple[dict[str, Any], str, torch.Tensor]] | None = None
        self.pins: list[_Pin] | None = None
        self._pinned_ids: set[int] = set()
        self._snapshotted: set[int] = set()

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        if self.pins is None:  # this call's forward (perhaps inside an outer recompute)
            yield from self._forward()
        else:
            with self._pinned():
                yield from self._swapped()

    # -- forward -------------------------------------------------------------

    def _forward(self) -> Iterator[None]:
        self.seen, self.pins = [], []
        if local.substitutions:  # the torch.func engine maps the slots itself: no pins
            self.pins = None
        for owner in self.owners:
            self._pin(type(owner).__qualname__, owner, recurse=False)
            self._snapshot_stateful(owner)  # children it may call as ``child.forward(x)``
        for root in self.roots:
            self._pin(type(root).__qualname__, root, recurse=True)
        with _watching(self) if self.watch else contextlib.nullcontext():
            yield
        if self.pins is None:
            self.pins = []
        # Versions as the forward left them: a module that writes its own parameter
        # in forward (``nn.Embedding(max_norm=...)``) writes it again in the recompute.
        for pin in self.pins:
            pin.version, pin.storage = pin.tensor._version, storage_of(pin.tensor)

    def _snapshot_stateful(self, owner: nn.Module) -> None:
        for sub in owner.modules():
            if id(sub) not in self._snapshotted and is_stateful(sub):
                self._snapshotted.add(id(sub))
                assert self.seen is not None, "this is a bug in remat, please report it"
                self.seen.extend(_copies(sub))

    def saw(self, module: nn.Module) -> None:
        """The forward is about to run ``module``: pin its subtree if not pinned yet."""
        if id(module) not in self._pinned_ids:
            self._pin(type(module).__qualname__, module, recurse=True)

    def _pin(self, where: str, module: nn.Module, recurse: bool) -> None:
        named = module.named_modules(remove_duplicate=False) if recurse else [("", module)]
        for prefix, sub in named:
            if id(sub) in self._pinned_ids:
                continue
            self._pinned_ids.add(id(sub))
            path = f"{where}.{prefix}" if prefix else where
            stateful = is_stateful(sub)
            if stateful and self.seen is not None and id(sub) not in self._snapshotted:
                self._snapshotted.add(id(sub))
                self.seen.extend(_copies(sub))
            if self.pins is not None:
                self.pins.extend(_pins(path, sub._parameters, parameter=True))
                if not stateful:  # stateful buffers: rule 2 instead
                    self.pins.extend(_pins(path, sub._buffers, parameter=False))

    # -- recompute -----------------------------------------------------------

    @contextlib.contextmanager
    def _pinned(self) -> Iterator[None]:
        assert self.pins is not None, "this is a bug in remat, please report it"
        if local.substitutions:  # the torch.func engine maps the slots itself
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
        if t._version == pin.version and (pin.storage is None or storage_of(t) == pin.storage):
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
        copies = self.seen or []
        if not copies:
            yield
            return
        originals = [(table, name, table[name]) for table, name, _ in copies]
        try:
            with _disable_current_modes(), torch.no_grad():
                for table, name, value in copies:
                    table[name] = value.clone()  # the recompute may write to it
            yield
        finally:
            for table, name, buffer in reversed(originals):
                table[name] = buffer


def _copies(module: nn.Module) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Snapshots of ``module``'s buffers, before its forward changes them."""
    # Outside the record/replay modes: the copies are not ops of the region.
    with _disable_current_modes(), torch.no_grad():
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
    hooks = nn.modules.module._global_forward_pre_hooks
    with _hook_lock:
        _watchers[0] += 1
        hooks[_HOOK_KEY] = _pre_hook
    stack: list[StateGuard] = local.__dict__.setdefault("watching", [])
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
    for guard in local.__dict__.get("watching", ()):
        guard.saw(module)


def state_guard_of(
    fn: Callable[..., Any], leaves: Iterable[Any] = (), label: str = "the region"
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
    if getattr(fn, "remat_guards_modules", False):
        return StateGuard(label, watch=False)  # a wrapped module's forward has its own guard
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
    return StateGuard(label, roots, owners)
