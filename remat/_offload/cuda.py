"""The CUDA host store: pinned buffers, side-stream copies, events, prefetch.

The store's rules are NOTE [ Offload: streams, events, prefetch ] rules 4-6 in
``_offload/store.py``. Every stream, event and allocation call goes through a
`CudaRuntime`, so that tests can run the store's own logic against a simulated
device that executes side-stream copies late and in varying order, and checks
that each wait, event and ``record_stream`` the rules name is really there
(``tests/offload/cuda_sim.py``). Production always uses `CudaRuntime` itself, which
calls ``torch.cuda`` and nothing else.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .pool import HostPool, as_layout
from .store import Handle, HostStore, nbytes

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

    __slots__ = ("buffer", "copying", "device", "device_tensor", "event", "host", "released")

    def __init__(
        self, buffer: torch.Tensor, host: torch.Tensor, device: torch.device, event: Any
    ) -> None:
        self.buffer = buffer
        self.host = host
        self.device = device
        #: The last copy that touched ``buffer`` (D2H, then H2D once prefetched).
        self.event = event
        self.device_tensor: torch.Tensor | None = None
        #: A prefetch is queueing the H2D copy; a release meanwhile is left to it.
        self.copying = False
        self.released = False


class CudaHostStore(HostStore):
    """Pinned host memory with side-stream copies and events (NOTE rules 4-6).

    Accepts CUDA tensors only; it creates no stream and no buffer until the
    first `put`, so constructing it without a GPU is fine. Its pinned buffers
    are pooled across steps: ``empty_cache()`` frees those no copy uses now
    (``torch.cuda.host_memory_stats()`` shows what torch's own pinned cache
    keeps in turn).

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
        # Fetched tensors -> the event of their H2D copy, for `reuse`. By
        # identity: a WeakKeyDictionary would compare tensors elementwise.
        self._fetched = WeakIdKeyDictionary()
        # Puts run on the main thread, fetches on autograd's device thread,
        # releases wherever an entry dies; reentrant: a GC pass inside a locked
        # section may reap into `release`.
        self._lock = threading.RLock()

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

    def empty_cache(self) -> None:
        """Free the pooled pinned buffers that no copy uses and no tensor is stored in."""
        with self._lock:
            self.pool.trim()

    def _side_streams(self, device: torch.device) -> tuple[Any, Any]:
        index = self._runtime.device_index(device)
        streams = self._streams.get(index)
        if streams is None:
            streams = (self._runtime.new_stream(device), self._runtime.new_stream(device))
            self._streams[index] = streams
        return streams

    def put(self, t: torch.Tensor) -> Handle:
        cuda = self._runtime
        with self._lock:
            d2h, _ = self._side_streams(t.device)
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
        with self._lock:
            slot = self._slots.get(handle)
            if slot is None or slot.device_tensor is not None:
                return  # released meanwhile by another thread, or already on its way
            slot.copying = True
            try:
                slot.device_tensor, slot.event = self._copy_back(slot)
            finally:
                slot.copying = False
            if slot.released:  # by a finalizer during the copy: give back after the H2D event
                slot.device_tensor = None
                self.pool.give_back(slot.buffer, slot.event)

    def _copy_back(self, slot: _Slot) -> tuple[torch.Tensor, Any]:
        """Queue the H2D copy of ``slot``; return the device tensor and the copy's event."""
        cuda = self._runtime
        _, h2d = self._side_streams(slot.device)
        cuda.wait_event(h2d, slot.event)  # the host data is complete
        # Allocated for h2d: no wait for the consumer stream's queued work.
        device = cuda.empty_on(h2d, slot.host, slot.device)
        cuda.copy_on(h2d, device, slot.host)
        return device, cuda.record_event(h2d)

    def get(self, handle: Handle) -> torch.Tensor:
        with self._lock:
            self.prefetch(handle)
            slot = self._slots[handle]
            device = slot.device_tensor
            assert device is not None, "this is a bug in remat, please report it"
            slot.device_tensor = None  # the caller owns it now
            event = self._fetched[device] = slot.event
        return self._ready(device, event)

    def reuse(self, value: torch.Tensor) -> torch.Tensor:
        with self._lock:
            event = self._fetched.get(value)
        return value if event is None else self._ready(value, event)

    def _ready(self, device: torch.Tensor, event: Any) -> torch.Tensor:
        """``device``, once the current stream waits for ``event``, its H2D copy."""
        cuda = self._runtime
        consumer = cuda.current_stream(device.device)
        cuda.wait_event(consumer, event)
        cuda.record_stream(device, consumer)  # freed later from consumer's side: no early reuse
        return device

    def release(self, handle: Handle) -> None:
        with self._lock:
            slot = self._slots.pop(handle)
            if slot.copying:  # reentered from `prefetch`, which gives the buffer back
                slot.released = True
                return
            self.pool.give_back(slot.buffer, slot.event)
