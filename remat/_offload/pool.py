"""Pooled host buffers in power-of-two sizes.

NOTE [ Offload: streams, events, prefetch ] (``store.py``), rule 6.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .store import nbytes


def _bucket(nbytes: int) -> int:
    """``nbytes`` rounded up to a power of two: what torch's pinned allocator allocates."""
    return 1 << max(nbytes - 1, 0).bit_length()


def host_buffer(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8)


def as_layout(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View the start of a byte ``buffer`` with ``like``'s dtype, shape and strides."""
    flat = buffer[: nbytes(like)].view(like.dtype)
    return flat.as_strided(like.shape, like.stride())


class HostPool:
    """Host buffers in power-of-two sizes, handed out again once their last copy is done.

    NOTE rule 6. A request for ``n`` bytes gets a buffer of the next power of
    two bytes (`as_layout` views its start), so varying shapes share buffers.

    Args:
        allocate: makes a new ``uint8`` buffer of the given byte size.
        done: whether an event given back with a buffer has completed.
    """

    def __init__(
        self,
        allocate: Callable[[int], torch.Tensor],
        done: Callable[[Any], bool] = lambda event: True,
    ) -> None:
        self._allocate = allocate
        self._done = done
        self.free: dict[int, list[torch.Tensor]] = {}
        self.busy: list[tuple[torch.Tensor, Any]] = []  # (buffer, event still running)
        #: Buffers the pool holds, in use or free (bounded when steps reuse them).
        self.allocated = 0
        #: Their bytes (rounded sizes): the host memory the pool holds.
        self.bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes that no copy uses."""
        self._reclaim()
        size = _bucket(nbytes)
        free = self.free.get(size)
        if free:
            return free.pop()
        self.allocated += 1
        self.bytes += size
        return self._allocate(size)

    def give_back(self, buffer: torch.Tensor, event: Any = None) -> None:
        if event is not None and not self._done(event):
            self.busy.append((buffer, event))
        else:
            self.free.setdefault(buffer.numel(), []).append(buffer)

    def trim(self) -> int:
        """Drop the buffers no copy uses (the busy ones stay); return the bytes dropped."""
        self._reclaim()
        free, self.free = self.free, {}  # a reentrant give_back fills the new dict
        dropped = [buffer for buffers in free.values() for buffer in buffers]
        self.allocated -= len(dropped)
        freed = sum(buffer.numel() for buffer in dropped)
        self.bytes -= freed
        return freed

    def _reclaim(self) -> None:
        busy, self.busy = self.busy, []  # a reentrant give_back appends to the new list
        for buffer, event in busy:
            if self._done(event):
                self.free.setdefault(buffer.numel(), []).append(buffer)
            else:
                self.busy.append((buffer, event))
