"""A simulated CUDA device, to test `CudaHostStore`'s own logic on the CPU.

Nothing here stands in for a CUDA result: the store's copies are plain CPU
copies. What the simulation checks is the store's protocol, the waits, events,
``record_stream`` calls and pool rules of NOTE [ Offload: streams, events,
prefetch ] rules 4-6, by running its side-stream work late and in an order that
a seeded RNG picks, and turning every ordering mistake into a visible failure:

- Tensors are CPU tensors. The current ("default") stream is eager: what is
  queued on it runs at once, after forcing whatever it waits for, because the
  Python compute that follows reads its inputs immediately.
- Side streams queue their work. At every runtime call a few runnable ops (a
  stream's next op whose waits are met) run, picked at random: copies run late
  and in varying order, as on a device.
- New host buffers and new device tensors are filled with ``0xFF`` bytes (NaN
  in floating point): a value read before its copy ran shows up in gradients.
- Hazards raise `SimulatedFault`: a copy that runs while an earlier-queued copy
  that touches the same storage (one of them writing) is still pending, i.e.
  a copy that overtook one it should have waited for.
- A device tensor a queued copy reads is held weakly, as the caching allocator
  holds nothing: if its storage died before the copy ran and no
  ``record_stream`` covered the copy's stream, the copy raises `SimulatedFault`
  (a use after free).
- `empty_on` remembers the stream a device tensor was allocated on: a copy into
  it on another stream that has not waited for that stream since raises
  `SimulatedFault` (the allocator may have handed out a block whose last reader
  on the allocating stream is still queued).
- Several eager streams: `use_stream` makes another one current, as
  ``torch.cuda.stream(s)``. Compute is invisible to the simulation, so a test
  calls `read` where a consumer reads a fetched tensor: it raises unless the
  current stream waited for the copy that wrote the tensor.

Not modeled:

- The current stream's own asynchrony: producing ops run at once, so the
  ``wait_stream(d2h, current)`` of ``put`` is checked only by the protocol
  test, not by any failure.
- The allocator handing a freed block to a new tensor: ``record_stream`` for
  the consumer stream (``get``, ``reuse``) is recorded in `calls`, not enforced.
- Reads that tests do not report through `read`, e.g. the backward pass's own:
  an eager stream's wait runs the copy for every stream at once, so a second
  stream that skips its wait still finds the data there.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from remat._offload.cuda import CudaHostStore


class SimulatedFault(AssertionError):
    """The store broke an ordering rule a real device would have turned into wrong data."""


_WeakTensor = tuple[StorageWeakRef, torch.dtype, int, tuple[int, ...], tuple[int, ...]]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _weak(t: torch.Tensor) -> _WeakTensor:
    """``t`` without keeping its memory alive: its storage, weakly, and its layout."""
    storage = StorageWeakRef(t.untyped_storage())
    return storage, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride())


@dataclass(eq=False)
class _Stream:
    name: str
    eager: bool
    ops: list[Any] = field(default_factory=list)
    done: int = 0  # ops run so far
    keep: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # record_stream
    waits: list[tuple[int, _Event]] = field(default_factory=list)  # (tick, event) waited for


@dataclass(frozen=True)
class _Event:
    stream: _Stream
    position: int  # completes once this many of the stream's ops have run

    @property
    def complete(self) -> bool:
        return self.stream.done >= self.position


@dataclass(eq=False)
class _Wait:
    event: _Event


@dataclass(eq=False)
class _Copy:
    seq: int
    stream: _Stream
    dst: torch.Tensor
    src: torch.Tensor | None  # held strongly: a host buffer
    src_ref: _WeakTensor | None
    reads: int
    writes: int

    def source(self) -> torch.Tensor:
        if self.src is not None:
            return self.src
        assert self.src_ref is not None
        ref, dtype, offset, shape, stride = self.src_ref
        if ref.expired():
            raise SimulatedFault(
                f"a copy on {self.stream.name} read a device tensor whose memory was "
                "freed before the copy ran (record_stream missing)"
            )
        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


class SimulatedCuda:
    """The `CudaRuntime` interface over CPU tensors, with late, reordered side streams.

    Args:
        seed: picks the order in which queued side-stream work runs.
        eagerness: how many runnable ops run, at most, at each runtime call.
    """

    def __init__(self, seed: int, eagerness: int = 2) -> None:
        self.rng = random.Random(seed)
        self.eagerness = eagerness
        self.default = _Stream("the current stream", eager=True)
        self.current = self.default
        self.side: list[_Stream] = []
        self.pending: list[_Copy] = []
        self.host_keys: set[int] = set()
        self.host_buffers = 0
        #: ``(method, stream name)`` for every wait, record_stream and empty_on, in order.
        self.calls: list[tuple[str, str]] = []
        # Device tensors by storage: (allocating stream, tick) until the first
        # copy into them, then the event of the copy that wrote them.
        self._allocated: dict[int, tuple[_Stream, int]] = {}
        self._written: dict[int, _Event] = {}
        self._seq = itertools.count()  # orders copies and waits: the simulation's clock
        self._running = False  # a finalizer inside a copy must not run copies
        #: Every fault raised, also those raised where Python swallows them (finalizers).
        self.faults: list[SimulatedFault] = []

    # -- the CudaRuntime interface ---------------------------------------

    def owns(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def device_index(self, device: torch.device) -> int:
        return 0

    def new_stream(self, device: torch.device) -> _Stream:
        stream = _Stream(f"side stream {len(self.side)}", eager=False)
        self.side.append(stream)
        return stream

    def current_stream(self, device: torch.device) -> _Stream:
        self._wander()
        return self.current

    def wait_stream(self, stream: _Stream, other: _Stream) -> None:
        self.calls.append(("wait_stream", stream.name))
        self._wait(stream, _Event(other, len(other.ops)))

    def wait_event(self, stream: _Stream, event: _Event) -> None:
        self.calls.append(("wait_event", stream.name))
        self._wait(stream, event)

    def record_event(self, stream: _Stream) -> _Event:
        self._wander()
        return _Event(stream, len(stream.ops))

    def done(self, event: _Event) -> bool:
        self._wander()
        return event.complete

    def host_buffer(self, size: int) -> torch.Tensor:
        buffer = torch.full((size,), 0xFF, dtype=torch.uint8)
        self.host_keys.add(_key(buffer))
        self.host_buffers += 1
        return buffer

    def empty_on(self, stream: _Stream, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.calls.append(("empty_on", stream.name))
        size = like.untyped_storage().nbytes() if like.numel() else 0
        raw = torch.full((max(size, 1),), 0xFF, dtype=torch.uint8)
        out = torch.empty(0, dtype=like.dtype)
        out.set_(raw.untyped_storage(), 0, like.shape, like.stride())
        self._allocated[_key(out)] = (stream, next(self._seq))
        self._written.pop(_key(out), None)  # a stale entry of a freed tensor at this address
        return out

    def copy_on(self, stream: _Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._wander()
        self._check_allocation(stream, dst)
        if _key(src) in self.host_keys:  # a pooled host buffer: the pool keeps it alive
            strong, weak = src, None
        else:  # a device tensor: the allocator keeps nothing alive for a copy
            strong, weak = None, _weak(src)
        op = _Copy(next(self._seq), stream, dst, strong, weak, _key(src), _key(dst))
        if stream.eager:
            self._execute(op)
            return
        stream.ops.append(op)
        self.pending.append(op)
        self._written[_key(dst)] = _Event(stream, len(stream.ops))

    def record_stream(self, t: torch.Tensor, stream: _Stream) -> None:
        self.calls.append(("record_stream", stream.name))
        if not stream.eager:
            stream.keep.append((len(stream.ops), t))

    # -- what the store does not call ------------------------------------

    @contextlib.contextmanager
    def use_stream(self, name: str) -> Iterator[None]:
        """Make a new eager stream current inside, as ``with torch.cuda.stream(s)``."""
        outer, self.current = self.current, _Stream(name, eager=True)
        try:
            yield
        finally:
            self.current = outer

    def read(self, t: torch.Tensor) -> None:
        """A consumer reads ``t`` on the current stream: it must have waited for its copy."""
        written = self._written.get(_key(t))
        if written is not None and not any(
            event.stream is written.stream and event.position >= written.position
            for _, event in self.current.waits
        ):
            self._fault(
                f"{self.current.name} read a tensor without waiting for the copy on "
                f"{written.stream.name} that wrote it"
            )

    def synchronize(self) -> None:
        """Run everything queued, as ``torch.cuda.synchronize()``."""
        for stream in self.side:
            self._force(_Event(stream, len(stream.ops)))

    def _check_allocation(self, stream: _Stream, dst: torch.Tensor) -> None:
        allocated = self._allocated.pop(_key(dst), None)
        if allocated is None or allocated[0] is stream:
            return
        owner, tick = allocated
        if not any(at > tick and event.stream is owner for at, event in stream.waits):
            self._fault(
                f"a copy on {stream.name} wrote a tensor allocated on {owner.name} "
                f"without waiting for {owner.name}"
            )

    # -- running queued work ---------------------------------------------

    def _wait(self, stream: _Stream, event: _Event) -> None:
        self._wander()
        stream.waits.append((next(self._seq), event))
        if stream.eager:
            self._force(event)
        else:
            stream.ops.append(_Wait(event))

    def _wander(self) -> None:
        if self._running:
            return
        for _ in range(self.rng.randint(0, self.eagerness)):
            runnable = [s for s in self.side if self._runnable(s)]
            if not runnable:
                return
            self._run_next(self.rng.choice(runnable))

    def _runnable(self, stream: _Stream) -> bool:
        if stream.done == len(stream.ops):
            return False
        op = stream.ops[stream.done]
        return not isinstance(op, _Wait) or op.event.complete

    def _force(self, event: _Event) -> None:
        while not event.complete:
            op = event.stream.ops[event.stream.done]
            if isinstance(op, _Wait):
                self._force(op.event)
            self._run_next(event.stream)

    def _run_next(self, stream: _Stream) -> None:
        op = stream.ops[stream.done]
        if isinstance(op, _Copy):
            self._execute(op)
            self.pending.remove(op)
        stream.done += 1
        stream.keep = [(at, t) for at, t in stream.keep if at > stream.done]

    def _execute(self, op: _Copy) -> None:
        for earlier in self.pending:
            if earlier.seq < op.seq and (
                earlier.writes in (op.reads, op.writes) or earlier.reads == op.writes
            ):
                self._fault(
                    f"a copy on {op.stream.name} ran before an earlier copy on "
                    f"{earlier.stream.name} that touches the same memory"
                )
        self._running = True
        try:
            op.dst.copy_(op.source())
        except SimulatedFault as fault:
            self.faults.append(fault)
            raise
        finally:
            self._running = False

    def _fault(self, message: str) -> None:
        fault = SimulatedFault(message)
        self.faults.append(fault)
        raise fault


def simulated_store(runtime: SimulatedCuda, **kwargs: Any) -> CudaHostStore:
    """A real `CudaHostStore` whose CUDA calls go to ``runtime``."""
    store = CudaHostStore(**kwargs)
    store._runtime = runtime  # type: ignore[assignment]
    return store
