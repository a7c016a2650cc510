"""Module state during a recompute: stateful modules change their buffers once.

A recompute runs ``forward`` again; modules that update buffers in forward
(BatchNorm's running statistics and ``num_batches_tracked``) would update them
twice. A `StateGuard` snapshots the buffers of a region's *stateful* modules
when its forward starts; while the region recomputes, each buffer is replaced
by a copy of its snapshot, and the originals are put back when the recompute
ends (also when the engine stops it early): the recompute sees the state the
forward saw, and changes nothing. The copies are made with the
recording/replay dispatch modes switched off, so the recompute runs exactly the
forward's ops. Stateful means: an instance of a registered type
(`register_stateful`; ``_NormBase``, i.e. BatchNorm/InstanceNorm/SyncBatchNorm,
is registered) or a module with the attribute ``remat_stateful = True``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from ._state import is_recomputing

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


class StateGuard:
    """Run the stateful modules among ``modules`` on the state their forward saw.

    Use one guard per region call, around the forward and around the recompute
    (`guarded`): in the forward it snapshots the stateful buffers (before the
    forward changes them); in the recompute it swaps every such buffer for a
    copy of its snapshot, and puts the real buffers back afterwards, also when
    the engine stops the recompute early. So the recompute computes with the
    numbers the forward used (BatchNorm's cumulative-average factor depends on
    ``num_batches_tracked``) and changes no real state.
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.modules = [m for m in modules if _is_stateful(m)]
        self.seen: list[tuple[dict[str, Any], str, torch.Tensor]] | None = None

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        if not self.modules:
            yield
        elif not is_recomputing():
            if self.seen is None:
                self.seen = self._copies()
            yield
        else:
            yield from self._swapped()

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


def state_guard_of(fn: Callable[..., Any], leaves: Iterable[Any] = ()) -> StateGuard:
    """A `StateGuard` for the modules a region runs.

    Those are ``fn`` itself when it is a module, the module of a bound method,
    modules among the call's argument ``leaves``, and modules ``fn`` closes
    over directly (a closure cell holding a module). Modules reached in other
    ways (a global, an attribute of an argument object) are not guarded: wrap
    them with `remat.wrap` instead.

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
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, nn.Module):
            roots.append(value)
    seen: dict[int, nn.Module] = {}
    for root in roots:
        for module in root.modules():
            seen.setdefault(id(module), module)
    return StateGuard(seen.values())
