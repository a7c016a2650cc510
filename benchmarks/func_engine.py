"""The torch.func engine against the eager engine's floor, on the benchmark stack.

For each width and policy: the exact peak bytes (`MemoryMeter`, one step) of
the eager engine under ``loss.backward()`` and of the torch.func engine under
``torch.func.grad`` of ``torch.func.functional_call`` (parameters detached, as
torch.func's own examples pass them), and each engine's step time as a ratio
to the same step without remat (eager: ``backward()``; torch.func: ``grad``),
timed interleaved in one run. The goal (issue 17): the torch.func peak and
time ratio within 1.05x of the eager engine's.

    python benchmarks/func_engine.py --repeats 21
    python benchmarks/func_engine.py --widths 16 --depth 2 --batch 2 --seq 8 --repeats 1

Time on a loaded machine is noise; ``--instructions`` instead counts callgrind
instructions per step (valgrind, one process, collecting only the measured
steps) of each engine with and without remat, on a small stack where the fixed
cost per region shows (default: width 16, seq 8, batch 4):

    python benchmarks/func_engine.py --instructions --widths 16 --seq 8 --batch 4
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from remat import _demo_model as demo
from remat._inspect.memory import MemoryMeter

POLICIES = ("nothing-saveable", "save-last", "dots-saveable")
MIB = 2**20

Step = Callable[[], Any]


def eager_step(stack: demo.Stack, x: torch.Tensor, how: str) -> Step:
    def step() -> dict[str, torch.Tensor]:
        for p in stack.parameters():
            p.grad = None
        stack.loss(x, how).backward()
        grads = {k: p.grad for k, p in stack.named_parameters() if p.grad is not None}
        for p in stack.parameters():
            p.grad = None
        return grads

    return step


def func_step(stack: demo.Stack, x: torch.Tensor, how: str) -> Step:
    params = {k: v.detach() for k, v in stack.named_parameters()}

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = torch.func.functional_call(stack, p, (x, how)).pow(2).mean()
        return out

    return lambda: torch.func.grad(loss)(params)


def peak(step: Step) -> tuple[int, Any]:
    with MemoryMeter() as meter:
        out = step()
    return meter.peak, out


def medians(steps: dict[str, Step], repeats: int) -> dict[str, float]:
    """Median seconds of each step, interleaved (the order turns each round)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(repeats + 1):
        for name in names[i % len(names):] + names[: i % len(names)]:
            start = time.perf_counter()
            steps[name]()
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run_width(width: int, depth: int, batch: int, seq: int, heads: int,
              repeats: int) -> list[dict[str, Any]]:
    stack = demo.Stack(depth=depth, width=width, heads=heads)
    x = demo.make_input(stack, batch=batch, seq=seq)
    _, expected = peak(func_step(stack, x, demo.NO_REMAT))
    rows = []
    for policy in POLICIES:
        eager_peak, eager_grads = peak(eager_step(stack, x, policy))
        func_peak, func_grads = peak(func_step(stack, x, policy))
        diff = max(
            max((func_grads[k] - g).abs().max().item(), (eager_grads[k] - g).abs().max().item())
            for k, g in expected.items()
        )
        row: dict[str, Any] = {
            "width": width, "policy": policy, "eager_peak": eager_peak,
            "func_peak": func_peak, "max_grad_diff": diff,
        }
        if repeats:
            t = medians({
                "eager none": eager_step(stack, x, demo.NO_REMAT),
                "eager remat": eager_step(stack, x, policy),
                "func none": func_step(stack, x, demo.NO_REMAT),
                "func remat": func_step(stack, x, policy),
            }, repeats)
            row["eager_time"] = t["eager remat"] / t["eager none"]
            row["func_time"] = t["func remat"] / t["func none"]
        rows.append(row)
    return rows


def _steps(width: int, depth: int, batch: int, seq: int, heads: int) -> dict[str, Step]:
    """Each engine's step without remat and with each policy, by name (``eager none``...)."""
    torch.manual_seed(0)
    stack = demo.Stack(depth=depth, width=width, heads=heads)
    x = demo.make_input(stack, batch=batch, seq=seq)
    return {
        f"{engine} {how}": make(stack, x, how)
        for how in (demo.NO_REMAT, *POLICIES)
        for engine, make in (("eager", eager_step), ("func", func_step))
    }


def _count_child(args: argparse.Namespace) -> None:
    """Inside valgrind: two warm steps, then two counted steps, one dump per variant."""
    for step in _steps(int(args.widths), args.depth, args.batch, args.seq, args.heads).values():
        step()
        step()
        torch._C._valgrind_toggle()
        step()
        step()
        torch._C._valgrind_toggle_and_dump_stats()


def instructions(args: argparse.Namespace) -> dict[str, float]:
    """Instructions per step of each variant (``--instructions``), from one valgrind run."""
    out_dir = tempfile.mkdtemp(prefix="remat-func-callgrind-")
    shape = [f"--{k}={getattr(args, k)}" for k in ("widths", "depth", "batch", "seq", "heads")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    try:
        subprocess.run([
            "valgrind", "--tool=callgrind", "--collect-atstart=no",
            f"--callgrind-out-file={out_dir}/cg", sys.executable, __file__,
            "--count-child", *shape,
        ], check=True, capture_output=True, env=env)
        dumps = sorted(glob.glob(f"{out_dir}/cg.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        totals = []
        for path in dumps:
            with open(path) as f:
                found = re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M)
            totals.append(int(found.group(1)) / 2 if found else float("nan"))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    names = [f"{e} {h}" for h in (demo.NO_REMAT, *POLICIES) for e in ("eager", "func")]
    return dict(zip(names, totals, strict=True))


def instructions_markdown(counts: dict[str, float]) -> str:
    lines = [
        "| policy | eager M instr / step | over no remat | torch.func M instr / step "
        "| over grad no remat | torch.func extra / eager extra |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for how in POLICIES:
        eager = counts[f"eager {how}"] - counts[f"eager {demo.NO_REMAT}"]
        func = counts[f"func {how}"] - counts[f"func {demo.NO_REMAT}"]
        lines.append(
            f"| {how} | {counts[f'eager {how}'] / 1e6:.1f} | +{eager / 1e6:.1f} | "
            f"{counts[f'func {how}'] / 1e6:.1f} | +{func / 1e6:.1f} | {func / eager:.2f}x |"
        )
    return "\n".join(lines)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| width | policy | eager peak MiB | torch.func peak MiB | peak ratio "
        "| eager time / no remat | torch.func time / grad no remat | time ratio |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        times = (
            f"{r['eager_time']:.3f}x | {r['func_time']:.3f}x | "
            f"{r['func_time'] / r['eager_time']:.3f}x"
            if "eager_time" in r else " |  | "
        )
        lines.append(
            f"| {r['width']} | {r['policy']} | {r['eager_peak'] / MIB:.2f} | "
            f"{r['func_peak'] / MIB:.2f} | {r['func_peak'] / r['eager_peak']:.3f}x | {times} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--widths", default="64,256", help="comma-separated (default: 64,256)")
    for name, default in (("depth", 8), ("batch", 8), ("seq", 128), ("heads", 4),
                          ("repeats", 21), ("threads", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--instructions", action="store_true",
                        help="callgrind instructions per step instead (one width)")
    parser.add_argument("--count-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.count_child:
        _count_child(args)
        return []
    if args.instructions:
        counts = instructions(args)
        print(instructions_markdown(counts))
        return [counts]
    rows = [
        row
        for width in (int(w) for w in args.widths.split(","))
        for row in run_width(width, args.depth, args.batch, args.seq, args.heads, args.repeats)
    ]
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
