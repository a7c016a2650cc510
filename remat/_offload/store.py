"""Host stores: where ``OFFLOAD`` decisions send tensors, and how they come back.

NOTE [ Offload: streams, events, prefetch ]
1. Interface. A `HostStore` has four verbs: ``put(t) -> handle`` starts moving a
   tensor off the device, ``prefetch(handle)`` starts bringing it back,
   ``get(handle)`` returns it (ready for use on the caller's stream) and
   ``release(handle)`` returns the host memory. ``accepts(t)`` says which
   tensors a store takes; the engines save the others on the device. A store
   takes only plain dense strided tensors: no conjugate or negative view (a
   device-to-host ``copy_`` applies the bit to the host copy before the
   transfer lands), no other layout, no quantized tensor, no subclass but
   ``Parameter`` (a wrapper such as DTensor reports its global shape).
2. Engines never call a store directly: `offload` wraps each handle in an
   `Offloaded` entry, shared by every consumer of the same value, which fetches
   at most once (the result is cached while the entry lives) and releases the
   handle right after the fetch, or when the entry dies unfetched. A later
   consumer gets the cached value through ``reuse(value)``: autograd runs each
   backward node on its forward's stream, so that consumer's stream may not be
   the one that fetched.
3. Prefetch order. Each store has a `_Schedule`: the entries not yet fetched,
   sorted by production order: ``(frame serial, op index, position)`` from the engine
   (a value can be put later than it was produced, see the eager engine's rule
   6), else the order of puts. Backward consumes them in reverse, so fetching
   the entry at position ``s`` first prefetches the ``prefetch_distance``
   pending entries just before ``s``: host-to-device copies run that many
   tensors ahead of use.
4. `CudaHostStore` (``cuda.py``), put: the side stream ``d2h`` waits
   for the current stream (so the copy starts after the producing op), copies
   into a pinned host buffer, and records an event. ``record_stream(d2h)`` tells the caching
   allocator that the device block is in use on ``d2h``: when the engine drops
   its last reference, the block is reused only after the copy is done.
5. `CudaHostStore`, prefetch: on the side stream ``h2d``, after waiting for the
   put's event, a device tensor is allocated and filled from the host buffer;
   an event marks the end of the copy. get: the consumer's stream waits for that
   event (a GPU-side wait, the CPU never blocks) and ``record_stream(consumer)``
   keeps the block from being reused by ``h2d`` while the consumer reads it.
   The store remembers that event per fetched tensor: reuse does the same wait
   and ``record_stream`` for a later consumer's stream. All four verbs hold the
   store's lock (backward runs on autograd's device thread, finalizers release
   wherever an entry dies); a release from inside a prefetch (a finalizer in a
   GC pass) leaves the buffer to the prefetch, which gives it back with its
   own event.
6. Host buffers are pooled (``pool.py``) in power-of-two byte sizes, as torch's pinned
   allocator rounds them (exact sizes would never be reused when shapes vary),
   and reused across steps (no ``cudaHostAlloc`` per step); ``empty_cache()``
   frees the pooled buffers no copy uses. A released buffer goes back to the
   pool with the last event that touched it, and is handed out again only once
   that event has completed: a new put never overwrites data an earlier copy
   still reads (the race behind NaN gradients in other offload implementations).
7. Which store (``selection.py``): the region's own (``Region.offload_store``), else the innermost
   `use_host_store`, else a process-wide `CudaHostStore`. CPU tensors are not
   accepted by the CUDA store, so on CPU ``OFFLOAD`` degrades to ``SAVE``.
"""

from __future__ import annotations

import abc
import bisect
import itertools
import threading
import weakref

import torch

__all__ = [
    "Handle",
    "HostStore",
    "Offloaded",
    "Order",
    "nbytes",
    "next_serial",
    "offload",
    "placeholder_for",
]

#: An opaque reference to one tensor in a store.
Handle = int
#: Production order of an offloaded value: (frame serial, op index, output position).
Order = tuple[int, int, int]

_serials = itertools.count()


def next_serial() -> int:
    """A number larger than every earlier one: engines order their frames by it."""
    return next(_serials)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its elements exactly once (a permuted contiguous layout)."""
    expected = 1
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _plain(t: torch.Tensor) -> bool:
    """Whether a byte copy of ``t``'s strided elements is its value (NOTE rule 1)."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)  # a wrapper's shape is not its data's
        and t.layout is torch.strided
        and not (t.is_quantized or t.is_nested or t.is_conj() or t.is_neg())
    )


def nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements of ``t`` (a dense tensor's storage size)."""
    return t.numel() * t.element_size()


class HostStore(abc.ABC):
    """Where offloaded tensors live between the forward and the backward pass.

    Subclasses implement `put`, `prefetch`, `get` and `release`; `accepts` says
    which tensors they take and `reuse` readies a fetched value for a second
    consumer. Stores are used through `offload`, which adds prefetch ordering
    (NOTE rule 3) and single fetches (rule 2).

    Args:
        min_bytes (int, optional): tensors smaller than this stay where they
            are (a copy costs more than it saves). Default: 65536.
        prefetch_distance (int, optional): how many tensors ahead of use the
            backward pass brings back. Default: 2.
    """

    def __init__(self, *, min_bytes: int = 1 << 16, prefetch_distance: int = 2) -> None:
        if min_bytes < 0 or prefetch_distance < 0:
            raise ValueError(
                f"remat.HostStore: min_bytes and prefetch_distance must be >= 0, got "
                f"{min_bytes} and {prefetch_distance}"
            )
        self.min_bytes = min_bytes
        self.prefetch_distance = prefetch_distance

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory this store has allocated (pooled, reused across steps)."""
        return 0

    def accepts(self, t: torch.Tensor) -> bool:
        """Whether ``t`` can be offloaded: a plain strided tensor, dense and large enough."""
        return _plain(t) and t.numel() > 0 and nbytes(t) >= self.min_bytes and _dense(t)

    def reuse(self, value: torch.Tensor) -> torch.Tensor:
        """Return ``value``, fetched earlier, ready for use on the current stream."""
        return value

    @abc.abstractmethod
    def put(self, t: torch.Tensor) -> Handle:
        """Start copying ``t`` to the host; the caller may drop ``t`` at once."""

    @abc.abstractmethod
    def prefetch(self, handle: Handle) -> None:
        """Start copying the tensor back; no-op when already started."""

    @abc.abstractmethod
    def get(self, handle: Handle) -> torch.Tensor:
        """Return the tensor, ready for use on the current stream."""

    @abc.abstractmethod
    def release(self, handle: Handle) -> None:
        """Give the host memory back; the handle is invalid afterwards."""


# -- entries and prefetch ordering -------------------------------------------


class Offloaded:
    """One offloaded value: fetched at most once, released when fetched or dead."""

    __slots__ = ("__weakref__", "_finalizer", "_schedule", "_value", "handle", "seq")

    def __init__(self, schedule: _Schedule, handle: Handle, seq: Order) -> None:
        self._schedule = schedule
        self.handle = handle
        #: Position in production order (NOTE rule 3).
        self.seq = seq
        self._value: torch.Tensor | None = None
        self._finalizer = weakref.finalize(self, schedule.drop, handle, seq)
        self._finalizer.atexit = False  # the CUDA context may be gone at exit

    def get(self) -> torch.Tensor:
        """Return the value, fetching it (and prefetching the ones before it) once."""
        if self._value is None:
            self._value = self._schedule.fetch(self.handle, self.seq)
            self._finalizer.detach()  # fetch released the handle already
            return self._value
        # Another consumer, maybe on another stream than the fetch (NOTE rule 2).
        return self._schedule.store.reuse(self._value)


class _Schedule:
    """Production order of one store's pending entries (NOTE rule 3)."""

    def __init__(self, store: HostStore) -> None:
        self.store = store
        self.pending: list[Order] = []  # orders put and not yet fetched, ascending
        self.handles: dict[Order, Handle] = {}
        self.prefetched: set[Order] = set()
        # Forward puts on the main thread; CUDA backward unpacks on autograd's
        # device thread, and finalizers run wherever the last reference dies,
        # possibly inside a locked section of this very thread (a GC pass):
        # `drop` therefore queues, and whoever holds the lock reaps the queue.
        self.lock = threading.Lock()
        self.dead: list[tuple[Handle, Order]] = []

    def put(self, t: torch.Tensor, seq: Order) -> Offloaded:
        handle = self.store.put(t)
        with self.lock:
            bisect.insort(self.pending, seq)
            self.handles[seq] = handle
        self.reap()
        return Offloaded(self, handle, seq)

    def fetch(self, handle: Handle, seq: Order) -> torch.Tensor:
        with self.lock:
            ahead = self._ahead(self._remove(seq))
        # The store is called without our lock: it takes its own, and `reap`
        # (holding ours) calls its `release`.
        self.reap()
        for other in ahead:
            self.store.prefetch(other)
        value = self.store.get(handle)
        self.store.release(handle)
        return value

    def drop(self, handle: Handle, seq: Order) -> None:
        self.dead.append((handle, seq))
        self.reap()

    def reap(self) -> None:
        """Release the handles of entries that died unfetched."""
        if not self.lock.acquire(blocking=False):
            return  # the holder reaps when it is done
        try:
            while self.dead:
                handle, seq = self.dead.pop()
                self._remove(seq)
                self.store.release(handle)
        finally:
            self.lock.release()

    def _remove(self, seq: Order) -> int:
        """Forget ``seq``; return where it was in ``pending``."""
        index = bisect.bisect_left(self.pending, seq)
        if index < len(self.pending) and self.pending[index] == seq:
            del self.pending[index]
        self.handles.pop(seq, None)
        self.prefetched.discard(seq)
        return index

    def _ahead(self, index: int) -> list[Handle]:
        """Handles to prefetch now: the k pending entries produced just before ``index``."""
        start = max(0, index - self.store.prefetch_distance)
        ahead = [s for s in reversed(self.pending[start:index]) if s not in self.prefetched]
        self.prefetched.update(ahead)
        return [self.handles[s] for s in ahead]


_schedules: weakref.WeakKeyDictionary[HostStore, _Schedule] = weakref.WeakKeyDictionary()
_schedules_lock = threading.Lock()


def offload(t: torch.Tensor, store: HostStore, order: Order | None = None) -> Offloaded | None:
    """Move ``t`` into ``store``; None when the store does not take it.

    The engines call this for every ``OFFLOAD`` decision and keep the returned
    entry instead of ``t``; ``entry.get()`` brings the value back in backward.

    Args:
        t (Tensor): the value to offload (not a parameter or a region input).
        store (HostStore): where to put it.
        order ((int, int, int), optional): its production order,
            ``(serial, op index, output position)`` with ``serial`` from
            `next_serial` when the region started. Default: after everything
            put so far.

    Returns:
        Offloaded | None: the entry, or None when ``store.accepts(t)`` is false.

    Examples:
        >>> import torch
        >>> from remat._offload.fake import FakeHostStore
        >>> store = FakeHostStore(min_bytes=0)
        >>> entry = offload(torch.arange(4.0), store)
        >>> entry.get()
        tensor([0., 1., 2., 3.])
        >>> [verb for verb, _ in store.log]
        ['put', 'get', 'release']
    """
    if not store.accepts(t):
        return None
    with _schedules_lock:
        schedule = _schedules.get(store)
        if schedule is None:
            schedule = _schedules[store] = _Schedule(store)
    return schedule.put(t, order if order is not None else (next_serial(), 0, 0))


def placeholder_for(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor that stands in an op record for an offloaded output until it is fetched."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
