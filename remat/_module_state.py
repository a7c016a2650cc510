"""Module state during a recompute: stateful modules change their buffers once.

A recompute runs ``forward`` again; modules that update buffers in forward
(BatchNorm's running statistics and ``num_batches_tracked``) would update them
twice. While `remat.is_recomputing` is true, every *stateful* module of a
region has each buffer replaced by a copy, and the originals are put back when
the recompute ends (also when the engine stops it early): the recompute sees
the state the forward left, and changes nothing. The copies are made with the
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

__all__ = ["frozen_state_of", "register_stateful"]

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


@contextlib.contextmanager
def _state_frozen(modules: Iterable[nn.Module]) -> Iterator[None]:
    """While recomputing, run stateful modules on copies of their buffers (NOTE rule 3)."""
    if not is_recomputing():
        yield
        return
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        # Outside the record/replay modes: the copies are not ops of the region.
        with _disable_current_modes(), torch.no_grad():
            for module in modules:
                if _is_stateful(module):
                    for name, buffer in module._buffers.items():
                        if buffer is not None:
                            swapped.append((module._buffers, name, buffer))
                            module._buffers[name] = buffer.clone()
        yield
    finally:
        for table, name, buffer in reversed(swapped):
            table[name] = buffer


def frozen_state_of(fn: Callable[..., Any]) -> contextlib.AbstractContextManager[None]:
    """Freeze the stateful modules of ``fn`` (a module or a bound method of one) in recompute.

    The engines' hook for plain ``remat.remat(module)`` regions (NOTE rule 3):
    outside a recompute, or when ``fn`` belongs to no module, it does nothing.

    Examples:
        >>> import torch
        >>> from remat._module_state import frozen_state_of
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> with frozen_state_of(bn):  # not recomputing: the real buffers update
        ...     _ = bn(torch.randn(4, 2))
        >>> int(bn.num_batches_tracked)
        1
    """
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(owner, nn.Module):
        return contextlib.nullcontext()
    return _state_frozen(owner.modules())
