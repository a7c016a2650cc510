"""Benchmark remat's policies against the tools users would otherwise pick.

On a GPT-style block stack (``remat._demo_model.Stack``) it measures one
training step (forward + backward of a mean-square loss) under: no
checkpointing, ``torch.utils.checkpoint`` (non-reentrant) per block, torch
selective checkpointing saving the ops remat's dots policies save,
``checkpoint_sequential`` (one segment per block), and every remat policy.

Per variant: peak and held bytes (exact on CPU: tensor storages beyond
parameters and input, counted by ``remat.measure_memory``), step time as
a ratio to no remat and to ``torch.utils.checkpoint`` measured in the same run
(median over repetitions, variants interleaved in a rotating order), and the
largest gradient difference from no remat. Then it shows that
``torch.utils.checkpoint`` raises under ``torch.func.grad`` while remat runs.

Run: ``python benchmarks/bench.py`` (``--help`` for sizes); writes
``benchmarks/results.json`` and prints a Markdown table. These are
measurements, not tests: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint as tuc

from remat import _demo_model as demo
from remat import measure_memory as measure_step

REMAT_POLICIES = (
    "nothing-saveable",
    "dots-saveable",
    "dots-no-batch-saveable",
    "save:attn_out",
    "save-last",
    "save-last+dots-saveable",
    "offload-dots",
    "everything-saveable",
)
TORCH_VARIANTS = (
    ("no remat", demo.NO_REMAT),
    ("torch checkpoint", demo.TORCH_CHECKPOINT),
    ("torch selective (dots ops)", demo.TORCH_SELECTIVE + "dots-saveable"),
    ("torch selective (2-D dots ops)", demo.TORCH_SELECTIVE + "dots-no-batch-saveable"),
)
SEQUENTIAL = "torch checkpoint_sequential"


@dataclasses.dataclass
class Row:
    """One variant's measurements."""

    variant: str
    peak_bytes: int
    held_bytes: int
    time_vs_none: float
    time_vs_torch: float
    max_grad_diff: float


def make_losses(model: demo.Stack) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every variant as a function from the input to the scalar loss."""
    losses: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for label, how in TORCH_VARIANTS:
        losses[label] = lambda x, how=how: model.loss(x, how)

    def sequential(x: torch.Tensor) -> torch.Tensor:
        blocks = list(model.blocks)
        out = tuc.checkpoint_sequential(blocks, len(blocks), x, use_reentrant=False)
        return out.pow(2).mean()

    losses[SEQUENTIAL] = sequential
    for policy in REMAT_POLICIES:
        losses[f"remat {policy}"] = lambda x, how=policy: model.loss(x, how)
    return losses


def grads_of(
    model: demo.Stack, loss: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss(x).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def step_seconds(
    model: demo.Stack, loss: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss(x).backward()
    return time.perf_counter() - start


def progress(done: int, total: int, what: str) -> None:
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def measure(model: demo.Stack, x: torch.Tensor, repeats: int) -> list[Row]:
    """Memory and gradients once per variant, then interleaved timed repetitions."""
    losses = make_losses(model)
    labels = list(losses)
    total = len(labels) * (1 + repeats)
    memory, grads = {}, {}
    for i, label in enumerate(labels):
        progress(i, total, label)
        model.zero_grad(set_to_none=True)
        memory[label] = measure_step(losses[label], x)
        grads[label] = grads_of(model, losses[label], x)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(repeats):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]  # rotate: no fixed slot
        for j, label in enumerate(order):
            progress(len(labels) * (1 + r) + j, total, f"timing {label}")
            times[label].append(step_seconds(model, losses[label], x))
    progress(total, total, "done")
    median = {label: statistics.median(ts) for label, ts in times.items()}
    ref = grads["no remat"]
    return [
        Row(
            label,
            memory[label].peak_bytes,
            memory[label].held_bytes,
            median[label] / median["no remat"],
            median[label] / median["torch checkpoint"],
            max((a - b).abs().max().item() for a, b in zip(grads[label], ref, strict=True)),
        )
        for label in labels
    ]


def under_torch_func_grad(model: demo.Stack, x: torch.Tensor) -> dict[str, str]:
    """Take one gradient under ``torch.func.grad`` with torch's and with remat's checkpoint."""
    params = dict(model.named_parameters())
    expected = torch.func.grad(
        lambda p: torch.func.functional_call(model, p, (x, demo.NO_REMAT)).pow(2).mean()
    )(params)
    outcome = {}
    for label, how in (
        ("torch checkpoint", demo.TORCH_CHECKPOINT),
        ("remat nothing-saveable", "nothing-saveable"),
        ("remat dots-saveable", "dots-saveable"),
    ):

        def loss(p: dict[str, torch.Tensor], how: str = how) -> torch.Tensor:
            return torch.func.functional_call(model, p, (x, how)).pow(2).mean()

        try:
            got = torch.func.grad(loss)(params)
        except Exception as error:  # reporting what happens is the point
            outcome[label] = f"raises {type(error).__name__}: {str(error).splitlines()[0]}"
            continue
        diff = max((got[k] - expected[k]).abs().max().item() for k in params)
        outcome[label] = f"runs; max grad diff vs no remat {diff:.1e}"
    return outcome


def markdown(rows: Sequence[Row]) -> str:
    """The Markdown table of the results."""
    header = (
        "variant",
        "peak bytes",
        "held bytes",
        "time / no remat",
        "time / torch checkpoint",
        "max grad diff",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * 5) + "|"]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.peak_bytes:,} | {r.held_bytes:,} | "
            f"{r.time_vs_none:.2f}x | {r.time_vs_torch:.2f}x | {r.max_grad_diff:.1e} |"
        )
    return "\n".join(lines)


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch "
        f"thread(s) of {__import__('os').cpu_count()} CPU cores, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def main(argv: Sequence[str] | None = None, small: bool = False) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON file; return the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = {
        "depth": 8,
        "width": 128,
        "heads": 4,
        "batch": 8,
        "seq": 128,
        "repeats": 7,
        "threads": 1,
    }
    if small:
        defaults |= {"depth": 2, "width": 16, "heads": 2, "batch": 2, "seq": 8, "repeats": 1}
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--json", default=str(pathlib.Path(__file__).with_name("results.json")))
    args = parser.parse_args([] if argv is None and small else argv)
    torch.set_num_threads(args.threads)
    model = demo.Stack(depth=args.depth, width=args.width, heads=args.heads)
    x = demo.make_input(model, batch=args.batch, seq=args.seq)
    rows = measure(model, x, args.repeats)
    func = under_torch_func_grad(model, x)
    config = {k: getattr(args, k) for k in defaults}
    print(f"GPT-style stack {config}, float32, CPU; {machine()}")
    print(markdown(rows))
    print("\nUnder torch.func.grad:")
    for label, what in func.items():
        print(f"- {label}: {what}")
    results = {
        "config": config,
        "machine": machine(),
        "rows": [dataclasses.asdict(r) for r in rows],
        "torch_func_grad": func,
    }
    if not small:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
