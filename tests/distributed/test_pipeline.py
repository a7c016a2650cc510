"""`remat.wrap`ed blocks under pipeline parallelism (``torch.distributed.pipelining``).

A GPT-style stack of four blocks is split into two stages, one per process
(gloo, CPU), and trained one step under GPipe and 1F1B with four microbatches.
Each configuration is compared with the same stack trained in one process on
all the data, without remat: the gradients of every parameter; each block
recomputes once per microbatch (``save-last``: every block but the last of its
stage, NOTE [ The last region of a chain ]); and each stage's peak memory,
counted exactly (`remat._memory.MemoryMeter`), is below the same schedule's
without remat.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import load_script
from process_group import DISTRIBUTED, run_in_group
from torch import nn

import remat
from remat._demo_model import Stack
from remat._inspect.memory import MemoryMeter

pytestmark = DISTRIBUTED

WORLD = 2
TIMEOUT_S = 180  # ~15 s alone, ~85 s on 2 shared cores under load; a hung try is started again
DEPTH, WIDTH, HEADS, SEQ = 4, 16, 2, 8
BATCH, MICROBATCHES = 8, 4
SCHEDULES = ("GPipe", "1F1B")
POLICIES = ("nothing-saveable", "dots-saveable", "save-last")
#: How often each block of a stage recomputes in one step, by policy.
RECOMPUTES = {
    "nothing-saveable": [MICROBATCHES, MICROBATCHES],
    "dots-saveable": [MICROBATCHES, MICROBATCHES],
    "save-last": [MICROBATCHES, 0],  # each microbatch's last block keeps its activations
}


class Counted(nn.Module):
    """A block that counts its forwards and its recomputes."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.forwards = 0
        self.recomputes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if remat.is_recomputing():
            self.recomputes += 1
        else:
            self.forwards += 1
        return self.block(x)  # type: ignore[no-any-return]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, WIDTH, generator=generator), torch.zeros(BATCH)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()  # a mean per microbatch: the schedule averages over them


def _stage_module(rank: int, policy: str | None) -> nn.Sequential:
    """This rank's half of the stack, each block wrapped (``policy`` None: not)."""
    blocks = list(Stack(depth=DEPTH, width=WIDTH, heads=HEADS).blocks)
    counted = [Counted(block) for block in blocks[rank * 2 : rank * 2 + 2]]
    if policy is not None:
        for block in counted:
            remat.wrap(block, policy=policy)
    return nn.Sequential(*counted)


def _step(rank: int, schedule_name: str, policy: str | None) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module = _stage_module(rank, policy)
    shape = (BATCH // MICROBATCHES, SEQ, WIDTH)
    # Static shapes: no shape-inference forward (and backward) before the step. The
    # second stage's input requires grad: its gradient goes back to the first stage.
    inputs = torch.empty(shape, requires_grad=rank > 0)
    outputs = torch.empty(shape, requires_grad=True)
    stage = PipelineStage(module, rank, WORLD, torch.device("cpu"), inputs, outputs)
    kind = ScheduleGPipe if schedule_name == "GPipe" else Schedule1F1B
    schedule = kind(stage, n_microbatches=MICROBATCHES, loss_fn=_loss)
    x, target = _data()
    with MemoryMeter() as meter:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target)
    return {
        "grads": {
            name.replace(".block.", "."): p.grad.detach().clone()
            for name, p in module.named_parameters()
        },
        "forwards": [block.forwards for block in module],
        "recomputes": [block.recomputes for block in module],
        "peak": meter.peak,
    }


def _collect(rank: int) -> dict[Any, Any]:
    return {
        (schedule, policy): _step(rank, schedule, policy)
        for schedule in SCHEDULES
        for policy in (*POLICIES, None)
    }


@pytest.fixture(scope="module")
def results() -> list[dict[Any, Any]]:
    return run_in_group(_collect, WORLD, TIMEOUT_S)


def _expected_grads() -> dict[str, torch.Tensor]:
    """One process, all the data, no remat: gradients by stage-local parameter name."""
    model = Stack(depth=DEPTH, width=WIDTH, heads=HEADS)
    x, target = _data()
    _loss(model(x), target).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _stage_name(rank: int, name: str) -> str:
    """``blocks.2.fc1.weight`` on rank 1 is its stage module's ``0.fc1.weight``."""
    _, index, rest = name.split(".", 2)
    return f"{int(index) - 2 * rank}.{rest}"


@pytest.mark.parametrize("policy", [*POLICIES, None])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_step_matches_one_process(
    results: list[dict[Any, Any]], schedule: str, policy: str | None
) -> None:
    expected = _expected_grads()
    for rank, by_config in enumerate(results):
        got = by_config[schedule, policy]["grads"]
        want = {
            _stage_name(rank, name): grad
            for name, grad in expected.items()
            if int(name.split(".")[1]) // 2 == rank
        }
        assert got.keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(
                got[name], grad, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, {name}"
            )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_block_recomputes_once_per_microbatch(
    results: list[dict[Any, Any]], schedule: str, policy: str
) -> None:
    for by_config in results:
        step = by_config[schedule, policy]
        assert step["forwards"] == [MICROBATCHES, MICROBATCHES]
        assert step["recomputes"] == RECOMPUTES[policy]
        assert by_config[schedule, None]["recomputes"] == [0, 0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_peak_per_stage_is_below_no_remat(results: list[dict[Any, Any]], schedule: str) -> None:
    for rank, by_config in enumerate(results):
        plain = by_config[schedule, None]["peak"]
        peaks = {policy: by_config[schedule, policy]["peak"] for policy in POLICIES}
        assert all(peak < plain for peak in peaks.values()), (rank, plain, peaks)
        if schedule == "1F1B" and rank == WORLD - 1:
            # The last stage runs each microbatch's backward right after its forward:
            # the last block's kept activations are what a recompute would rebuild.
            assert peaks["save-last"] == peaks["nothing-saveable"], peaks
        else:
            # Microbatches in flight each keep their last block until their backward.
            assert peaks["nothing-saveable"] < peaks["save-last"], (rank, peaks)


def _benchmark(rank: int) -> Any:
    bench = load_script("benchmarks", "pipeline")
    return bench.measure(rank, bench.SMALL)


def test_benchmark_runs_small_and_reports_what_the_tests_assert() -> None:
    bench = load_script("benchmarks", "pipeline")
    results = run_in_group(_benchmark, WORLD, TIMEOUT_S)
    for rows in results:
        for schedule in SCHEDULES:
            plain = rows[f"{schedule} None"]
            assert plain["recomputes"] == [0, 0] and plain["time_ratio"] == 1.0
            assert rows[f"{schedule} {bench.TORCH}"]["recomputes"] == [MICROBATCHES] * 2
            for policy in POLICIES:
                row = rows[f"{schedule} {policy}"]
                assert row["recomputes"] == RECOMPUTES[policy]
                assert row["peak"] < plain["peak"] and row["time_ratio"] > 0
    table = bench.markdown(results, MICROBATCHES)
    assert "| GPipe | save-last | 1 |" in table and "[4, 0]" in table
