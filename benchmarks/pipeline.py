"""Pipeline parallelism: per-stage peak, recomputes and step time, with and without remat.

A GPT-style stack (`remat._demo_model`) is split into two stages, one per
process (gloo, CPU, loopback), each block wrapped by `remat.wrap` under a
policy, and trained under ``ScheduleGPipe`` and ``Schedule1F1B``. For each
schedule and policy, each stage reports its exact peak bytes of one step
(`MemoryMeter`, tensor storages), how often its blocks recomputed, and its
median step time over the median of the same schedule without remat, timed
interleaved in the same run (absolute times are not comparable between runs
on shared machines). ``save-last`` keeps each microbatch's last block per
stage (NOTE [ The last region of a chain ] in ``remat/_engines/last_regions.py``).

    python benchmarks/pipeline.py
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat
from remat import _demo_model as demo
from remat._inspect.memory import MemoryMeter

WORLD = 2
SCHEDULES = ("GPipe", "1F1B")
#: None: no remat; TORCH: ``torch.utils.checkpoint`` (non-reentrant) around each block.
TORCH = "torch checkpoint"
POLICIES = (None, TORCH, "nothing-saveable", "dots-saveable", "save-last")
SMALL = {"width": 16, "depth": 4, "batch": 8, "seq": 8, "heads": 2, "microbatches": 4,
         "repeats": 1}
FULL = {"width": 128, "depth": 8, "batch": 16, "seq": 64, "heads": 4, "microbatches": 4,
        "repeats": 5}


class Counted(nn.Module):
    """A block that counts its recomputes (remat's; ``torch_checkpoint``: torch's)."""

    def __init__(self, block: nn.Module, torch_checkpoint: bool = False) -> None:
        super().__init__()
        self.block = block
        self.torch_checkpoint = torch_checkpoint
        self.forwards = 0
        self.calls = 0

    @property
    def recomputes(self) -> int:
        return self.calls - self.forwards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if self.torch_checkpoint:  # torch's recompute calls `_run`, not `forward`
            return checkpoint(self._run, x, use_reentrant=False)  # type: ignore[no-any-return]
        return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        # remat's recompute runs `forward` again (the wrapped forward is this one).
        if remat.is_recomputing():
            self.forwards -= 1
        self.calls += 1
        return self.block(x)  # type: ignore[no-any-return]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


class Stage:
    """This rank's blocks under one schedule and policy, ready to step."""

    def __init__(self, rank: int, schedule: str, policy: str | None, size: dict[str, int]) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stack = demo.Stack(depth=size["depth"], width=size["width"], heads=size["heads"])
        half = size["depth"] // WORLD
        mine = list(stack.blocks)[rank * half : (rank + 1) * half]
        self.blocks = [Counted(b, torch_checkpoint=policy == TORCH) for b in mine]
        if policy not in (None, TORCH):
            for block in self.blocks:
                remat.wrap(block, policy=policy)
        self.module = nn.Sequential(*self.blocks)
        shape = (size["batch"] // size["microbatches"], size["seq"], size["width"])
        stage = PipelineStage(
            self.module, rank, WORLD, torch.device("cpu"),
            torch.empty(shape, requires_grad=rank > 0), torch.empty(shape, requires_grad=True),
        )
        kind = ScheduleGPipe if schedule == "GPipe" else Schedule1F1B
        self.schedule = kind(stage, n_microbatches=size["microbatches"], loss_fn=_loss)
        self.rank = rank
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(size["batch"], size["seq"], size["width"], generator=generator)

    def step(self) -> None:
        self.module.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(self.x)
        else:
            self.schedule.step(target=torch.zeros(len(self.x)))


def measure(rank: int, size: dict[str, int]) -> dict[str, Any]:
    """This rank's peaks, recomputes and step-time ratios, for every schedule and policy."""
    rows: dict[str, Any] = {}
    for schedule in SCHEDULES:
        stages = {policy: Stage(rank, schedule, policy, size) for policy in POLICIES}
        for policy, stage in stages.items():
            with MemoryMeter() as meter:
                stage.step()
            rows[f"{schedule} {policy}"] = {
                "peak": meter.peak, "recomputes": [b.recomputes for b in stage.blocks],
            }
        times: dict[str | None, list[float]] = {policy: [] for policy in POLICIES}
        for i in range(size["repeats"] + 1):
            order = POLICIES if i % 2 else POLICIES[::-1]  # interleaved, both ways
            for policy in order:
                dist.barrier()  # both stages start each step together
                start = time.perf_counter()
                stages[policy].step()
                if i:  # the first round warms up
                    times[policy].append(time.perf_counter() - start)
        plain = statistics.median(times[None])
        for policy in POLICIES:
            rows[f"{schedule} {policy}"]["time_ratio"] = statistics.median(times[policy]) / plain
    return rows


def _worker(rank: int, port: int, out_dir: str, size: dict[str, int]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        torch.set_num_threads(1)
        torch.save(measure(rank, size), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def markdown(results: list[dict[str, Any]], microbatches: int) -> str:
    lines = [
        "| schedule | policy | stage | peak bytes | peak / no remat's | recomputes per block "
        f"({microbatches} microbatches) | step time / no remat's |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for schedule in SCHEDULES:
        for policy in POLICIES:
            for rank, rows in enumerate(results):
                row, plain = rows[f"{schedule} {policy}"], rows[f"{schedule} None"]
                lines.append(
                    f"| {schedule} | {policy or 'no remat'} | {rank} | {row['peak']:,} | "
                    f"{row['peak'] / plain['peak']:.2f}x | {row['recomputes']} | "
                    f"{row['time_ratio']:.2f}x |"
                )
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in FULL.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    size = vars(parser.parse_args(argv))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on 127.0.0.1
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker, args=(_free_port(), out_dir, size), nprocs=WORLD, start_method="spawn"
        )
        results = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(WORLD)]
    print(markdown(results, size["microbatches"]))
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
