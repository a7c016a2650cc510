"""`CudaHostStore`'s stream, event and pool protocol, on a simulated device.

The store under test is the real `CudaHostStore`; only its CUDA calls go to
`cuda_sim.SimulatedCuda`, which runs side-stream copies late and reordered and
turns each missing wait, event or ``record_stream`` into a fault or a NaN. The
negative controls below remove one rule at a time and check that the
simulation catches it, so a green run here means each rule is present.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from cuda_sim import SimulatedCuda, SimulatedFault, simulated_store
from helpers import assert_close_all, grads
from hypothesis import given, settings
from hypothesis import strategies as st

import remat
from remat._offload import use_host_store

SEEDS = range(12)


def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
    return torch.sin(h @ w2) + x


def stack(fn: Callable[..., torch.Tensor], n: int) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        for i in range(n):
            x = fn(x, ws[2 * i], ws[2 * i + 1])
        return x

    return run


def make_inputs(n: int) -> list[torch.Tensor]:
    x = torch.randn(6, 4, requires_grad=True)
    return [x] + [torch.randn(4, 4, requires_grad=True) for _ in range(2 * n)]


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
        ("wait_event", "the current stream"),  # the fetched copy is complete
        ("record_stream", "the current stream"),
    ]
    store.release(handle)


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
@pytest.mark.parametrize("broken", [SkipsSideWaits, ConsumerSkipsWait, SkipsRecordStream])
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
