"""The slots a region's modules hold tensors in, and what they held when the forward ran.

`Pin`: a parameter or buffer slot and its tensor (identity, version, storage) before
the forward, so the recompute reads the same tensor; `Watched`: a slot of a module
the forward runs, with a snapshot when rule 1 copies it (NOTE [ State the forward
changes ] in ``_capture/module_state.py``); `Accumulations`: rule 3's ``.grad`` watch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .._compat import (
    add_post_accumulate_hook,
    is_functorch_wrapped,
    no_dispatch_modes,
    storage_identity,
)
from .._errors import RematError
from .._replay.saved_signatures import STANDS_FOR_LEAF
from .._state import internal, local

__all__ = [
    "SNAPSHOT_BYTES",
    "Accumulations",
    "Pin",
    "Watched",
    "buffer_copies",
    "has_grad_slot",
    "linked_copy",
    "pins_of",
    "replaced",
    "settle_pins",
    "unrestorable",
    "watch_slots",
]

#: Buffers up to this size are copied when the forward first sees their module,
#: in case it writes them (NOTE [ State the forward changes ] rule 1).
SNAPSHOT_BYTES = 1 << 20


@dataclasses.dataclass
class Pin:
    """A parameter or buffer slot, and the tensor in it before the forward ran the module."""

    where: str
    table: dict[str, Any]
    name: str
    tensor: torch.Tensor
    version: int
    storage: int | None
    parameter: bool


def pins_of(where: str, table: dict[str, Any], parameter: bool) -> list[Pin]:
    """Pins of ``table``'s tensors. Their storage is read when the forward ends or
    stops (what the recompute compares with), not here: once per tensor."""
    return [
        Pin(where, table, name, t, t._version, None, parameter)
        for name, t in table.items()
        if isinstance(t, torch.Tensor)
    ]


@dataclasses.dataclass
class Watched:
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


def watch_slots(
    where: str, module: nn.Module, stateful: bool, known: set[tuple[int, str, int]]
) -> list[Watched]:
    """Watch ``module``'s parameters and buffers not in ``known``, copying what rule 1 copies.

    A stateful module's buffers are rule 2's (`buffer_copies`); its parameters are
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
    for parameter, table, name, t in new:
        known.add((id(table), name, id(t)))
        small = not parameter and t.numel() * t.element_size() <= SNAPSHOT_BYTES
        snapshot = _snapshot(t) if stateful or small else None
        watched.append(
            Watched(where, table, name, t, t._version, snapshot, parameter, parameter and renorms)
        )
    return watched


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    # Our copies are no ops of the region (nor calls of its function). Entered per
    # copy: most slots (parameters of modules that are not stateful) copy nothing.
    with no_dispatch_modes(), internal(), torch.no_grad():
        return t.detach().clone()


def linked_copy(current: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
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


def has_grad_slot(t: Any) -> bool:
    """Whether ``t`` is a plain leaf that autograd accumulates a ``.grad`` into."""
    return (
        isinstance(t, torch.Tensor)
        and t.requires_grad
        and t.is_leaf
        and not is_functorch_wrapped(t)
    )


class Accumulations:
    """The leaves a backward on this thread accumulates into while the forward runs (rule 3).

    A post-accumulate-grad hook per watched leaf, not a before/after comparison of
    ``.grad``: another thread training on the same parameters changes ``.grad``
    too, and the recompute must not undo its work.
    """

    def __init__(self) -> None:
        self.thread = local.thread_token
        #: (hook table, key) of each watched leaf's entry (`add_post_accumulate_hook`).
        self.handles: list[tuple[dict[int, Any], int]] = []
        self.hit: dict[int, tuple[torch.Tensor, bool]] = {}
        self.ids: set[int] = set()
        #: id(leaf) -> whether its ``.grad`` was None when watched.
        self.started_empty: dict[int, bool] = {}

    def watch(self, t: torch.Tensor) -> None:
        if id(t) in self.ids:
            return
        self.ids.add(id(t))
        self.started_empty[id(t)] = t.grad is None
        self.handles.append(add_post_accumulate_hook(t, self._accumulated))

    def _accumulated(self, leaf: torch.Tensor) -> None:
        if local.thread_token is self.thread:
            self.hit.setdefault(id(leaf), (leaf, self.started_empty[id(leaf)]))

    def close(self) -> list[tuple[torch.Tensor, bool]]:
        """Stop watching; the leaves accumulated into, with whether ``.grad`` was None."""
        for table, key in self.handles:
            table.pop(key, None)
        self.handles, self.ids, self.started_empty = [], set(), {}
        hit, self.hit = list(self.hit.values()), {}
        return hit


def settle_pins(pins: list[Pin], reads: set[int]) -> None:
    """At the forward's end: a buffer slot the forward rebound without reading the
    tensor it held before (``register_buffer`` again, a grown cache) holds what the
    recompute reads; ``reads``: ids of the tensors the forward's ops got (NOTE [
    Bindings the recompute reads ] rule 8 in ``_engines/eager/bindings.py``)."""
    for pin in pins:
        current = pin.table.get(pin.name)
        if (
            not pin.parameter
            and isinstance(current, torch.Tensor)
            and current is not pin.tensor
            and id(pin.tensor) not in reads
        ):
            pin.tensor = current


def unrestorable(watched: Watched, label: str) -> RematError:
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


def replaced(current: torch.Tensor, pin: Pin) -> bool:
    """Whether ``current`` is another tensor than the forward's, not a view of its memory.

    A tensor subclass (FSDP's sharded DTensor parameters) cannot be compared by
    memory: its slot is left as it is.
    """
    if current is pin.tensor or pin.storage is None:
        return False
    return storage_identity(current) != pin.storage


def buffer_copies(module: nn.Module) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Snapshots of ``module``'s buffers, before its forward changes them."""
    # Outside the record/replay modes: the copies are not ops of the region.
    with no_dispatch_modes(), internal(), torch.no_grad():
        return [
            (module._buffers, name, buffer.clone())
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]
