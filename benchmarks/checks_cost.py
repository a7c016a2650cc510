"""What the recompute checks cost, and what the torch.func engine holds.

The determinism check now runs under every policy: in the eager engine each
saved tensor's signature (shape, dtype, device, producing op) is compared in
the recompute; in the torch.func engine every torch call of the recompute is
compared with the forward's. ``determinism_check=False`` turns both off, so
the same program with the check on and off, timed interleaved in one run,
gives the check's cost as a ratio. Memory is counted exactly (tensor storages,
`MemoryMeter`) for one step in each engine: the torch.func engine must hold no
more than the eager engine does for the same policy.

    python benchmarks/checks_cost.py --repeats 21
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

import remat
from remat import _demo_model as demo
from remat._inspect.memory import MemoryMeter

POLICIES = ("nothing-saveable", "dots-saveable")


class Regions(nn.Module):
    """The benchmark stack with every block a region (``policy=None``: no remat)."""

    def __init__(self, stack: demo.Stack, policy: str | None, check: bool) -> None:
        super().__init__()
        self.stack = stack
        self.runs: list[Callable[..., torch.Tensor]] = [
            block if policy is None
            else remat.remat(block, policy=policy, determinism_check=check)
            for block in stack.blocks
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for run in self.runs:
            x = run(x)
        return x.pow(2).mean()


def eager_step(model: Regions, x: torch.Tensor) -> None:
    model(x).backward()


def func_step(model: Regions, x: torch.Tensor) -> None:
    params = {f"stack.{name}": p for name, p in model.stack.named_parameters()}
    torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)))(params)


STEPS: dict[str, Callable[[Regions, torch.Tensor], None]] = {
    "eager": eager_step, "torch.func": func_step,
}


def _zero(stack: demo.Stack) -> None:
    for p in stack.parameters():
        p.grad = None


def timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def check_cost(stack: demo.Stack, x: torch.Tensor, engine: str, policy: str,
               repeats: int) -> float:
    """Median step time with the check on over the median with it off (interleaved)."""
    on, off = Regions(stack, policy, True), Regions(stack, policy, False)
    step = STEPS[engine]
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats + 1):
        for check in ((True, False) if i % 2 else (False, True)):
            _zero(stack)
            seconds = timed(lambda m=(on if check else off): step(m, x))
            if i:  # the first round warms up
                times[check].append(seconds)
    return statistics.median(times[True]) / statistics.median(times[False])


def peak_bytes(stack: demo.Stack, x: torch.Tensor, engine: str, policy: str | None) -> int:
    """Exact peak bytes of one step beyond what existed before it (parameters, input)."""
    model = Regions(stack, policy, True)
    _zero(stack)
    with MemoryMeter() as meter:
        STEPS[engine](model, x)
    _zero(stack)
    return meter.peak


def run(width: int, depth: int, batch: int, seq: int, heads: int,
        repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    stack = demo.Stack(depth=depth, width=width, heads=heads)
    x = demo.make_input(stack, batch=batch, seq=seq)
    costs = {
        (e, p): check_cost(stack, x, e, p, repeats) for e in STEPS for p in POLICIES if repeats
    }
    peaks = {(e, p): peak_bytes(stack, x, e, p) for e in STEPS for p in (None, *POLICIES)}
    return {"costs": costs, "peaks": peaks}


def markdown(result: dict[str, Any]) -> str:
    lines = ["| engine | policy | step time, check on / off | peak bytes | peak / no remat's |",
             "|---|---|---:|---:|---:|"]
    peaks = result["peaks"]
    for (engine, policy), peak in peaks.items():
        cost = result["costs"].get((engine, policy))
        ratio = peak / peaks[(engine, None)]
        lines.append(
            f"| {engine} | {policy or 'no remat'} | "
            f"{'' if cost is None else f'{cost:.3f}x'} | {peak:,} | {ratio:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("width", 128), ("depth", 8), ("batch", 8), ("seq", 128),
                          ("heads", 4), ("repeats", 21)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args.width, args.depth, args.batch, args.seq, args.heads, args.repeats)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
