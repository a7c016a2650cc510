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
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from ._closure import global_names
from ._errors import SavedInputMutatedError
from ._state import is_recomputing, local

__all__ = ["StateGuard", "register_stateful", "state_guard_of"]

_STATEFUL_TYPES: list[type] = [nn.modules.batchnorm._NormBase]


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
    if cls not in _STATEFUL_TYPES:
        _STATEFUL_TYPES.append(cls)
    return cls


def _is_stateful(module: nn.Module) -> bool:
    return bool(getattr(module, "remat_stateful", False)) or isinstance(
        module, tuple(_STATEFUL_TYPES)
    )


@dataclasses.dataclass
class _Pin:
    """A parameter or buffer slot, and the tensor the forward saw in it."""

    module: nn.Module
    table: dict[str, Any]
    name: str
    tensor: torch.Tensor
    version: int
    storage: int | None

    def __str__(self) -> str:
        kind = "parameter" if self.table is self.module._parameters else "buffer"
        return f"{kind} '{self.name}' of {type(self.module).__qualname__}"


def _storage(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (not its address: FSDP frees and refills it)."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor(t)
    if wrapped or type(t) not in (torch.Tensor, nn.Parameter):
        return None  # a tensor subclass (DTensor) or a functorch wrapper: no plain storage
    return int(t.untyped_storage()._cdata)


def _replaced(current: torch.Tensor, pin: _Pin) -> bool:
    """Whether ``current`` is another tensor than the forward's, not a view of its memory."""
    return current is not pin.tensor and (pin.storage is None or _storage(current) != pin.storage)


class StateGuard:
    """Run the modules among ``modules`` on the parameters and state their forward saw.

    Use one guard per region call, around the forward and around the recompute
    (`guarded`). After the forward it remembers the tensor in every parameter
    and buffer slot (rule 1 below); for stateful modules it also snapshots the
    buffers before the forward changes them (rule 2). In the recompute:

    1. A slot that holds another tensor than in the forward, with other memory,
       gets the forward's tensor back while the recompute runs: a
       reparametrization that ended before backward (``torch.func.functional_call``
       puts the module's own tensors back when it returns) does not change what
       the recompute computes. A new view of the same memory (FSDP's unsharded
       views) is left alone. A forward tensor modified in place since (an
       optimizer step before backward) raises `SavedInputMutatedError`, as
       autograd does, instead of recomputing from the new values. Inside the
       torch.func engine the slots are its own (``_closure.py`` snapshots them),
       so this rule stands aside there.
    2. Every buffer of a stateful module is swapped for a copy of its snapshot,
       and the real buffers are put back afterwards, also when the engine stops
       the recompute early. So the recompute computes with the numbers the
       forward used (BatchNorm's cumulative-average factor depends on
       ``num_batches_tracked``) and changes no real state.
    """

    def __init__(self, modules: Iterable[nn.Module], label: str = "the region") -> None:
        self.all = list(modules)
        self.modules = [m for m in self.all if _is_stateful(m)]
        self.label = label
        self.seen: list[tuple[dict[str, Any], str, torch.Tensor]] | None = None
        self.pins: list[_Pin] | None = None

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        if not self.all:
            yield
        elif self.pins is None:  # this call's forward (perhaps inside an outer recompute)
            if self.modules and not is_recomputing():
                self.seen = self._copies()
                yield
            elif self.modules:
                yield from self._swapped()
            else:
                yield
            self.pins = self._pins()
        else:
            with self._pinned():
                if self.modules:
                    yield from self._swapped()
                else:
                    yield

    def _pins(self) -> list[_Pin]:
        if local.slot_swaps:  # the torch.func engine's own snapshot is in charge
            return []
        stateful = {id(m) for m in self.modules}
        pins = []
        for module in self.all:
            tables: list[dict[str, Any]] = [module._parameters]
            if id(module) not in stateful:  # stateful buffers: rule 2 instead
                tables.append(module._buffers)
            for table in tables:
                for name, t in table.items():
                    if isinstance(t, torch.Tensor):
                        pins.append(_Pin(module, table, name, t, t._version, _storage(t)))
        return pins

    @contextlib.contextmanager
    def _pinned(self) -> Iterator[None]:
        assert self.pins is not None, "this is a bug in remat, please report it"
        if local.slot_swaps:  # the torch.func engine's own snapshot is in charge
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
        if t._version == pin.version and (pin.storage is None or _storage(t) == pin.storage):
            return
        if pin.table is pin.module._parameters:
            cause = "an optimizer step or a '.data' assignment before backward?"
            fix = "Call backward before modifying parameters."
        else:
            cause = "the module updates it in its forward and ran again before backward?"
            fix = (
                "If the module updates this buffer in forward (running statistics, a power "
                "iteration), declare it stateful: remat.register_stateful(type(module)) or "
                "module.remat_stateful = True."
            )
        raise SavedInputMutatedError(
            f"remat: the {pin} (shape {tuple(t.shape)}) was modified in place between the "
            f"forward pass of {self.label} and its recompute (version {t._version}, "
            f"expected {pin.version}; {cause}), so the recompute would use the new "
            f"values. {fix}"
        )

    def _copies(self) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
        # Outside the record/replay modes: the copies are not ops of the region.
        with _disable_current_modes(), torch.no_grad():
            return [
                (module._buffers, name, buffer.clone())
                for module in self.modules
                for name, buffer in module._buffers.items()
                if buffer is not None
            ]

    def _swapped(self) -> Iterator[None]:
        if self.seen is None:
            # First run inside another region's recompute (nesting): the buffers are
            # that region's copies of its snapshot, i.e. what this forward saw. Keep
            # them for this region's own (two-level) recompute, which runs after the
            # outer one has put the real, updated buffers back.
            self.seen = self._copies()
        copies = self.seen
        originals = [(table, name, table[name]) for table, name, _ in copies]
        try:
            with _disable_current_modes(), torch.no_grad():
                for table, name, value in copies:
                    table[name] = value.clone()  # the recompute may write to it
            yield
        finally:
            for table, name, buffer in reversed(originals):
                table[name] = buffer


def _named_modules(fn: Any) -> Iterator[nn.Module]:
    """The modules a function's closure cells and globals hold."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, nn.Module):
            yield value
    if isinstance(fn, types.FunctionType):
        scope = fn.__globals__
        for name in global_names(fn.__code__):
            value = scope.get(name)
            if isinstance(value, nn.Module):
                yield value


def state_guard_of(
    fn: Callable[..., Any], leaves: Iterable[Any] = (), label: str = "the region"
) -> StateGuard:
    """A `StateGuard` for the modules a region runs.

    Those are ``fn`` itself when it is a module, the module of a bound method,
    modules among the call's argument ``leaves``, and modules ``fn`` names
    directly (a closure cell or a global holding a module). Modules reached in
    other ways (an attribute of an argument object) are not guarded: wrap them
    with `remat.wrap` instead.

    Examples:
        >>> import torch, remat
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> guard = state_guard_of(bn)
        >>> with guard.guarded():  # not recomputing: snapshot, then the real buffers update
        ...     _ = bn(torch.randn(4, 2))
        >>> int(bn.num_batches_tracked), int(guard.seen[-1][2])
        (1, 0)
    """
    roots: list[nn.Module] = []
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        roots.append(owner)
    roots.extend(leaf for leaf in leaves if isinstance(leaf, nn.Module))
    roots.extend(_named_modules(getattr(fn, "__func__", fn)))
    seen: dict[int, nn.Module] = {}
    for root in roots:
        for module in root.modules():
            seen.setdefault(id(module), module)
    return StateGuard(seen.values(), label)
