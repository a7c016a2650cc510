"""The CUDA host store: pinned buffers, side-stream copies, events, prefetch.

The store's rules are NOTE [ Offload: streams, events, prefetch ] rules 4-6 in
``_offload.py``. Every stream, event and allocation call goes through a
`CudaRuntime`, so that tests can run the store's own logic against a simulated
device that executes side-stream copies late and in varying order, and checks
that each wait, event and ``record_stream`` the rules name is really there
(``tests/cuda_sim.py``). Production always uses `CudaRuntime` itself, which
calls ``torch.cuda`` and nothing else.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch

from ._offload import Handle, HostPool, HostStore, as_layout, nbytes

__all__ = ["CudaHostStore", "CudaRuntime"]


class CudaRuntime:
    """The CUDA calls `CudaHostStore` makes: streams, events, copies, allocations."""

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives on a device this runtime drives."""
        return t.is_cuda

    def device_index(self, device: torch.device) -> int:
        return device.index if device.index is not None else torch.cuda.current_device()

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def wait_stream(self, stream: Any, other: Any) -> None:
        """Work queued on ``stream`` from now on starts after ``other``'s queued work."""
        stream.wait_stream(other)

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work queued on ``stream`` from now on starts after ``event`` completes."""
        stream.wait_event(event)

    def record_event(self, stream: Any) -> Any:
        """An event that completes when the work queued on ``stream`` so far has run."""
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def host_buffer(self, size: int) -> torch.Tensor:
        """A pinned ``uint8`` host buffer of ``size`` bytes."""
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def empty_on(self, stream: Any, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A device tensor laid out as ``like``, allocated for use on ``stream``."""
        with torch.cuda.stream(stream):
            return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device)

    def copy_on(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on ``stream``; the CPU does not wait for it."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """The caching allocator reuses ``t``'s block only after ``stream``'s queued work."""
        t.record_stream(stream)


class _Slot:
    """One offloaded tensor: its host buffer and, once prefetched, its device copy."""

    __slots__ = ("buffer", "device", "device_tensor", "event", "host")

    def __init__(
        self, buffer: torch.Tensor, host: torch.Tensor, device: torch.device, event: Any
    ) -> None:
        self.buffer = buffer
        self.host = host
        self.device = device
        #: The last copy that touched ``buffer`` (D2H, then H2D once prefetched).
        self.event = event
        self.device_tensor: torch.Tensor | None = None


class CudaHostStore(HostStore):
    """Pinned host memory with side-stream copies and events (NOTE rules 4-6).

    Accepts CUDA tensors only; it creates no stream and no buffer until the
    first `put`, so constructing it without a GPU is fine.

    Args:
        min_bytes (int, optional): smaller tensors stay on the device. Default: 65536.
        prefetch_distance (int, optional): tensors brought back ahead of use. Default: 2.

    Examples:
        >>> import torch
        >>> store = CudaHostStore()
        >>> store.accepts(torch.ones(1 << 20))  # a CPU tensor: saved, not offloaded
        False
    """

    def __init__(self, *, min_bytes: int = 1 << 16, prefetch_distance: int = 2) -> None:
        super().__init__(min_bytes=min_bytes, prefetch_distance=prefetch_distance)
        self._runtime = CudaRuntime()
        self.pool = HostPool(self._host_buffer, self._done)
        self._slots: dict[Handle, _Slot] = {}
        self._streams: dict[int, tuple[Any, Any]] = {}  # device index -> (d2h, h2d)
        self._handles = itertools.count()
        self._lock = threading.RLock()  # a GC pass inside `put` may reap into `release`

    def _host_buffer(self, size: int) -> torch.Tensor:
        return self._runtime.host_buffer(size)

    def _done(self, event: Any) -> bool:
        return self._runtime.done(event)

    def accepts(self, t: torch.Tensor) -> bool:
        return self._runtime.owns(t) and super().accepts(t)

    @property
    def host_bytes(self) -> int:
        """Bytes of pinned host buffers in the pool (in use or free)."""
        return self.pool.bytes

    def _side_streams(self, device: torch.device) -> tuple[Any, Any]:
        index = self._runtime.device_index(device)
        streams = self._streams.get(index)
        if streams is None:
            streams = (self._runtime.new_stream(device), self._runtime.new_stream(device))
            self._streams[index] = streams
        return streams

    def put(self, t: torch.Tensor) -> Handle:
        cuda = self._runtime
        d2h, _ = self._side_streams(t.device)
        with self._lock:
            buffer = self.pool.take(nbytes(t))
        host = as_layout(buffer, t)
        cuda.wait_stream(d2h, cuda.current_stream(t.device))  # after the producing op
        cuda.copy_on(d2h, host, t)
        event = cuda.record_event(d2h)
        cuda.record_stream(t, d2h)  # the block outlives our reference until the copy is done
        handle = next(self._handles)
        self._slots[handle] = _Slot(buffer, host, t.device, event)
        return handle

    def prefetch(self, handle: Handle) -> None:
        slot = self._slots.get(handle)
        if slot is None or slot.device_tensor is not None:
            return  # released meanwhile by another thread, or already on its way
        cuda = self._runtime
        _, h2d = self._side_streams(slot.device)
        cuda.wait_event(h2d, slot.event)  # the host data is complete
        # Allocated for h2d: no wait for the consumer stream's queued work.
        device = cuda.empty_on(h2d, slot.host, slot.device)
        cuda.copy_on(h2d, device, slot.host)
        slot.event = cuda.record_event(h2d)
        slot.device_tensor = device

    def get(self, handle: Handle) -> torch.Tensor:
        self.prefetch(handle)
        slot = self._slots[handle]
        device = slot.device_tensor
        assert device is not None, "this is a bug in remat, please report it"
        cuda = self._runtime
        consumer = cuda.current_stream(device.device)
        cuda.wait_event(consumer, slot.event)
        cuda.record_stream(device, consumer)  # freed later from consumer's side: no early reuse
        slot.device_tensor = None  # the caller owns it now
        return device

    def release(self, handle: Handle) -> None:
        slot = self._slots.pop(handle)
        with self._lock:
            self.pool.give_back(slot.buffer, slot.event)
