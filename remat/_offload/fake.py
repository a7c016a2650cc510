"""A CPU-to-CPU host store that records every call: the offload protocol tested without a GPU."""

from __future__ import annotations

import itertools

import torch

from .pool import HostPool, as_layout, host_buffer
from .store import Handle, HostStore, nbytes


class FakeHostStore(HostStore):
    """A CPU-to-CPU store that records every call, to test the protocol without a GPU.

    It accepts CPU tensors, copies them into pooled buffers on `put`, and
    appends ``(verb, handle)`` to `log` for every call. ``empty_cache()`` frees
    the pooled buffers no tensor uses now.

    Args:
        min_bytes (int, optional): smaller tensors are not taken. Default: 0.
        prefetch_distance (int, optional): tensors fetched ahead of use. Default: 2.

    Examples:
        >>> store = FakeHostStore()
        >>> h = store.put(torch.ones(2))
        >>> store.get(h), store.log
        (tensor([1., 1.]), [('put', 0), ('get', 0)])
    """

    def __init__(self, *, min_bytes: int = 0, prefetch_distance: int = 2) -> None:
        super().__init__(min_bytes=min_bytes, prefetch_distance=prefetch_distance)
        self.pool = HostPool(host_buffer)
        self.log: list[tuple[str, Handle]] = []
        self.live: dict[Handle, tuple[torch.Tensor, torch.Tensor]] = {}  # (buffer, view)
        self.fetched: dict[Handle, torch.Tensor] = {}
        self._handles = itertools.count()

    def accepts(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and super().accepts(t)

    @property
    def host_bytes(self) -> int:
        """Bytes of the (unpinned) buffers in the pool (in use or free)."""
        return self.pool.bytes

    def empty_cache(self) -> None:
        """Free the pooled buffers that hold no offloaded tensor."""
        self.pool.trim()

    def calls(self, verb: str) -> list[Handle]:
        """The handles passed to ``verb`` ("put", "prefetch", "get", "release"), in order."""
        return [handle for name, handle in self.log if name == verb]

    def put(self, t: torch.Tensor) -> Handle:
        handle = next(self._handles)
        buffer = self.pool.take(nbytes(t))
        host = as_layout(buffer, t)
        host.copy_(t)
        self.live[handle] = (buffer, host)
        self.log.append(("put", handle))
        return handle

    def prefetch(self, handle: Handle) -> None:
        self.log.append(("prefetch", handle))
        if handle in self.live and handle not in self.fetched:
            self.fetched[handle] = self.live[handle][1].clone()

    def get(self, handle: Handle) -> torch.Tensor:
        self.log.append(("get", handle))
        value = self.fetched.pop(handle, None)
        return value if value is not None else self.live[handle][1].clone()

    def release(self, handle: Handle) -> None:
        self.log.append(("release", handle))
        self.fetched.pop(handle, None)
        buffer, _ = self.live.pop(handle)
        self.pool.give_back(buffer)
