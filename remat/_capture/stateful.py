"""Which modules are stateful (update buffers in forward), and which region functions
guard their own modules: the registrations `StateGuard` reads.
"""

from __future__ import annotations

import abc

from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm

from .._compat import stateful_module_types

__all__ = ["GuardsItsModules", "is_stateful", "register_stateful"]

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


class GuardsItsModules(abc.ABC):  # noqa: B024 - a marker: registered types, no methods
    """A region function that runs its modules under a `StateGuard` of its own.

    A wrapped module's forward and a `sequential` segment guard the modules they
    run; `state_guard_of` gives their region a guard that watches nothing.
    Declare one with ``@GuardsItsModules.register``.
    """
