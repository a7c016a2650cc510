"""`CudaHostStore`'s stream, event and pool protocol, on a simulated device.

The store under test is the real `CudaHostStore`; only its CUDA calls go to
`cuda_sim.SimulatedCuda`, which runs side-stream copies late and reordered and
turns each missing wait, event or ``record_stream`` into a fault or a NaN. The
negative controls below remove one rule at a time and check that the
simulation catches it, so a green run here means each rule is present.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from cuda_sim import SimulatedCuda, SimulatedFault, simulated_store
from helpers import assert_close_all, grads, stack
from hypothesis import given, settings
from hypothesis import strategies as st
from test_offload import block, make_inputs

import remat
from remat._offload.cuda import CudaHostStore
from remat._offload.selection import use_host_store
from remat._offload.store import offload

SEEDS = range(12)


def eager_step(runtime: SimulatedCuda, policy: str = "offload-dots", distance: int = 2,
               blocks: int = 4) -> None:
    """One training step through the simulated store; raises on a wrong gradient."""
    inputs = make_inputs(blocks)
    expected = grads(stack(block, blocks), inputs)
    store = simulated_store(runtime, min_bytes=0, prefetch_distance=distance)
    with use_host_store(store):
        out = stack(remat.remat(block, policy=policy), blocks)(*inputs)
    gc.collect()  # the engine has dropped its device originals: only record_stream holds them
    actual = torch.autograd.grad(out.sum(), inputs)
    assert_close_all(actual, expected)
    runtime.synchronize()
    assert not store._slots, "every handle released"
    assert not runtime.faults


def functional_step(runtime: SimulatedCuda, policy: str = "offload-dots") -> None:
    inputs = make_inputs(2)
    x, ws = inputs[0], inputs[1:]

    def loss(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda *v: f(x, *v).sum()

    expected = torch.func.grad(loss(stack(block, 2)), argnums=(0, 1, 2, 3))(*ws)
    store = simulated_store(runtime, min_bytes=0)
    with use_host_store(store):
        actual = torch.func.grad(
            loss(stack(remat.remat(block, policy=policy), 2)), argnums=(0, 1, 2, 3)
        )(*ws)
    assert_close_all(actual, expected)
    runtime.synchronize()
    assert not store._slots
    assert not runtime.faults


@pytest.mark.parametrize("policy", ["offload-dots", "offload:hidden", "offload-dots-no-batch"])
@pytest.mark.parametrize("seed", SEEDS)
def test_eager_gradients_under_any_copy_order(seed: int, policy: str) -> None:
    runtime = SimulatedCuda(seed)
    eager_step(runtime, policy)
    assert runtime.host_buffers > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_functional_gradients_under_any_copy_order(seed: int) -> None:
    functional_step(SimulatedCuda(seed))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    eagerness=st.integers(0, 4),
    distance=st.integers(0, 4),
    blocks=st.integers(1, 5),
    policy=st.sampled_from(["offload-dots", "offload:hidden", "offload-dots+save:hidden"]),
)
def test_property_any_schedule_any_distance(
    seed: int, eagerness: int, distance: int, blocks: int, policy: str
) -> None:
    eager_step(SimulatedCuda(seed, eagerness), policy, distance, blocks)


def test_copies_really_run_late() -> None:
    # The simulation is only a test if side-stream work is still queued when the
    # forward returns and the backward fetches it: check it is, for most seeds.
    late = 0
    for seed in SEEDS:
        runtime = SimulatedCuda(seed)
        store = simulated_store(runtime, min_bytes=0)
        inputs = make_inputs(4)
        with use_host_store(store):
            out = stack(remat.remat(block, policy="offload-dots"), 4)(*inputs)
        late += bool(runtime.pending)
        out.sum().backward()
    assert late >= len(SEEDS) // 2


def test_protocol_calls() -> None:
    runtime = SimulatedCuda(0)
    store = simulated_store(runtime, min_bytes=0)
    handle = store.put(torch.randn(4, 4))
    d2h = store._streams[0][0].name
    assert runtime.calls == [("wait_stream", d2h), ("record_stream", d2h)]
    store.get(handle)
    h2d = store._streams[0][1].name
    assert runtime.calls[2:] == [
        ("wait_event", h2d),  # the host copy is complete
        ("empty_on", h2d),  # allocated for h2d: no wait for the consumer's queued work
        ("wait_event", "the current stream"),  # the fetched copy is complete
        ("record_stream", "the current stream"),
    ]
    store.release(handle)


def test_second_reader_on_another_stream_waits_for_the_fetch() -> None:
    # Autograd runs each backward node on its forward's stream: the cached value
    # of an entry read by two nodes reaches a stream that did not fetch it.
    runtime = SimulatedCuda(0, eagerness=0)
    store = simulated_store(runtime, min_bytes=0)
    entry = offload(torch.randn(4, 4), store)
    assert entry is not None
    with runtime.use_stream("stream A"):
        first = entry.get()
        runtime.read(first)
    runtime.calls.clear()
    with runtime.use_stream("stream B"):
        second = entry.get()
        runtime.read(second)
    assert second is first
    assert runtime.calls == [("wait_event", "stream B"), ("record_stream", "stream B")]
    assert not runtime.faults


def test_a_read_without_a_wait_is_caught() -> None:
    # Negative control for `read`: the second stream skips `reuse`.
    runtime = SimulatedCuda(0, eagerness=0)
    store = simulated_store(runtime, min_bytes=0)
    handle = store.put(torch.randn(4, 4))
    with runtime.use_stream("stream A"):
        value = store.get(handle)
    with runtime.use_stream("stream B"), pytest.raises(SimulatedFault, match="without waiting"):
        runtime.read(value)
    store.release(handle)


class ReleasesInsideCopy(SimulatedCuda):
    """Releases a handle while the store queues a host-to-device copy.

    As a finalizer does when a GC pass runs inside `prefetch` (``same_thread``),
    or as the main thread does while autograd's device thread prefetches.
    """

    def __init__(self, same_thread: bool) -> None:
        super().__init__(0, eagerness=0)
        #: The store and handle to release inside the next host-to-device copy.
        self.target: tuple[CudaHostStore, int] | None = None
        self.same_thread = same_thread
        self.released_inside = False
        self.thread: threading.Thread | None = None

    def copy_on(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        super().copy_on(stream, dst, src)
        if self.target is None or src.untyped_storage().data_ptr() not in self.host_keys:
            return  # not a host-to-device copy
        store, handle = self.target
        self.target = None
        if self.same_thread:
            store.release(handle)
            return
        done = threading.Event()
        self.thread = threading.Thread(target=lambda: (store.release(handle), done.set()))
        self.thread.start()
        self.released_inside = done.wait(0.2)  # the store's lock should hold it back


@pytest.mark.parametrize("same_thread", [True, False])
def test_release_during_prefetch_keeps_the_buffer_until_its_copy(same_thread: bool) -> None:
    runtime = ReleasesInsideCopy(same_thread)
    store = simulated_store(runtime, min_bytes=0)
    first = store.put(torch.randn(8, 8))
    runtime.synchronize()  # the host copy is done: only the prefetch will read the buffer
    buffer = store._slots[first].buffer
    runtime.target = (store, first)
    store.prefetch(first)
    if runtime.thread is not None:
        assert not runtime.released_inside, "a release ran in the middle of a prefetch"
        runtime.thread.join()
    assert first not in store._slots
    second = store.put(torch.randn(8, 8))
    assert store._slots[second].buffer is not buffer, "buffer handed out under a pending read"
    runtime.synchronize()
    assert not runtime.faults
    store.release(second)


def test_empty_cache_frees_only_buffers_no_copy_uses() -> None:
    runtime = SimulatedCuda(0, eagerness=0)
    store = simulated_store(runtime, min_bytes=0)
    kept, busy = store.put(torch.randn(8, 8)), store.put(torch.randn(16, 16))
    store.prefetch(busy)
    store.release(busy)  # its host-to-device copy has not run
    store.empty_cache()
    assert store.host_bytes == 256 + 1024 and store.pool.allocated == 2
    runtime.synchronize()
    store.empty_cache()
    assert store.host_bytes == 256 and store.pool.allocated == 1
    store.release(kept)
    store.empty_cache()
    assert store.host_bytes == 0 and store.pool.allocated == 0 and not store.pool.free


def test_pool_reused_over_steps() -> None:
    runtime = SimulatedCuda(3)
    counts = []
    store = simulated_store(runtime, min_bytes=0)
    inputs = make_inputs(4)
    for _ in range(20):
        with use_host_store(store):
            out = stack(remat.remat(block, policy="offload-dots"), 4)(*inputs)
        out.sum().backward()
        counts.append(store.pool.allocated)
    runtime.synchronize()
    assert counts[-1] == counts[4] <= 16, counts


def test_pool_waits_for_an_unfinished_copy() -> None:
    # A value prefetched and then dropped unfetched: its host buffer goes back to
    # the pool while the host-to-device copy may still be reading it.
    for seed in SEEDS:
        runtime = SimulatedCuda(seed, eagerness=0)
        assert not put_after_pending_read(runtime), "buffer handed out under a pending read"
        runtime.synchronize()
        assert not runtime.faults


def put_after_pending_read(runtime: SimulatedCuda) -> bool:
    """Release a buffer under a pending read, then put again; whether the buffer was reused."""
    store = simulated_store(runtime, min_bytes=0)
    first = store.put(torch.randn(8, 8))
    store.prefetch(first)
    buffer = store._slots[first].buffer
    store.release(first)
    second = store.put(torch.randn(8, 8))
    return store._slots[second].buffer is buffer


# -- negative controls: remove one rule, the simulation must notice ------------


class SkipsSideWaits(SimulatedCuda):
    """The host-to-device copy does not wait for the device-to-host copy."""

    def wait_event(self, stream: Any, event: Any) -> None:
        if stream.eager:
            super().wait_event(stream, event)


class ConsumerSkipsWait(SimulatedCuda):
    """The consumer reads the fetched tensor without waiting for its copy."""

    def wait_event(self, stream: Any, event: Any) -> None:
        if not stream.eager:
            super().wait_event(stream, event)


class SkipsRecordStream(SimulatedCuda):
    """Nothing tells the allocator that a side stream still reads a device tensor."""

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        pass


class AllocatesOnConsumer(SimulatedCuda):
    """The fetched tensor is allocated on the consumer stream, which h2d never waits for."""

    def empty_on(self, stream: Any, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        return super().empty_on(self.current, like, device)


class PoolIgnoresEvents(SimulatedCuda):
    """The pool hands a buffer out again before the copy reading it has run."""

    def done(self, event: Any) -> bool:
        return True


def _caught(step: Callable[[SimulatedCuda], Any], broken: type[SimulatedCuda]) -> int:
    caught = 0
    for seed in SEEDS:
        runtime = broken(seed, eagerness=seed % 3)
        try:
            step(runtime)
        except (SimulatedFault, AssertionError):
            caught += 1
        else:
            caught += bool(runtime.faults)  # raised in a finalizer, where Python swallows it
    return caught


# A fault in a finalizer reaches pytest as an unraisable-exception warning.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "broken", [SkipsSideWaits, ConsumerSkipsWait, SkipsRecordStream, AllocatesOnConsumer]
)
def test_each_missing_rule_is_caught(broken: type[SimulatedCuda]) -> None:
    assert _caught(eager_step, broken) > 0
    assert _caught(functional_step, broken) > 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_missing_pool_event_check_is_caught() -> None:
    def step(runtime: SimulatedCuda) -> None:
        put_after_pending_read(runtime)
        runtime.synchronize()

    assert put_after_pending_read(PoolIgnoresEvents(0, eagerness=0))
    assert _caught(step, PoolIgnoresEvents) > 0
