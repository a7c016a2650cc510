"""``python -m remat``: what each policy costs on a small GPT-style block stack (CPU).

For every variant it prints the peak bytes of one training step, the bytes held
for backward after the forward, how many ops the backward recomputes, the step
time as a ratio to no remat and to ``torch.utils.checkpoint`` (medians of
interleaved repetitions in this run), and whether the gradients match no
remat's.

Memory is counted exactly by `remat.testing.MemoryMeter` (tensor storages;
parameters and the input are the baseline, not counted). "Recomputed ops" is
the number of aten compute ops (views and detaches excluded) the backward runs,
minus the number no remat's backward runs: the forward ops repeated.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import time
from collections.abc import Sequence

import torch

from . import _demo_model as demo
from ._inspect.memory import ComputeOpCounter, measure_memory

__all__ = ["VARIANTS", "Row", "format_table", "main"]

#: (label, the `Stack` checkpointing string), in table order.
VARIANTS: tuple[tuple[str, str], ...] = (
    ("no remat", demo.NO_REMAT),
    ("torch checkpoint", demo.TORCH_CHECKPOINT),
    ("torch selective (dots)", demo.TORCH_SELECTIVE + "dots-saveable"),
    *((policy, policy) for policy in (
        "nothing-saveable",
        "dots-saveable",
        "dots-no-batch-saveable",
        "save:attn_out",
        "save-last",
        "save-last+dots-saveable",
        "everything-saveable",
    )),
)

_CHECKPOINT = "torch checkpoint"

#: Why the default size is what it is (printed under the table).
SIZE_NOTE = (
    f"size: width {demo.DEMO_WIDTH}, seq {demo.DEMO_SEQ} by default, where saving the "
    "matmuls pays on CPU: there torch's selective checkpointing runs faster than its full "
    "checkpointing, and dots-saveable faster than nothing-saveable. At smaller sizes "
    "(width 64) a matmul costs less to recompute than the bookkeeping of saving it, in "
    "torch's selective checkpointing as in remat (benchmarks/width_sweep.py measures "
    "each width)."
)

#: Largest gradient difference from no remat that still counts as a match.
GRAD_TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the demo table."""

    label: str
    peak_bytes: int
    held_bytes: int
    recomputed_ops: int
    time_ratio: float
    grad_diff: float
    #: Step time relative to ``torch.utils.checkpoint`` in the same run (nan without it).
    checkpoint_ratio: float = float("nan")

    @property
    def grads_match(self) -> bool:
        """Whether every gradient is within `GRAD_TOLERANCE` of no remat's."""
        return self.grad_diff <= GRAD_TOLERANCE


def _backward_ops_and_grads(
    model: demo.Stack, x: torch.Tensor, how: str
) -> tuple[int, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model.loss(x, how)
    with ComputeOpCounter() as counter:  # active in backward only: recompute lands here
        loss.backward()
    return counter.count, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _step_seconds(model: demo.Stack, x: torch.Tensor, how: str) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model.loss(x, how).backward()
    return time.perf_counter() - start


def run(
    model: demo.Stack,
    x: torch.Tensor,
    variants: Sequence[tuple[str, str]] = VARIANTS,
    repeats: int = 5,
) -> list[Row]:
    """Measure every variant on ``model`` and ``x``; the first variant is the reference."""
    memory, ops, grads = {}, {}, {}
    for label, how in variants:
        # Counting first warms up one-time allocations, which must not reach the meter.
        ops[label], grads[label] = _backward_ops_and_grads(model, x, how)
        model.zero_grad(set_to_none=True)
        memory[label] = measure_memory(lambda x, how=how: model.loss(x, how), x)
    # Interleaved, so that a slow moment of a noisy machine hits every variant alike.
    times: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(repeats):
        for label, how in variants:
            times[label].append(_step_seconds(model, x, how))
    ref = variants[0][0]
    ref_time = statistics.median(times[ref])
    ckpt_time = statistics.median(times[_CHECKPOINT]) if _CHECKPOINT in times else float("nan")
    return [
        Row(
            label=label,
            peak_bytes=memory[label].peak_bytes,
            held_bytes=memory[label].held_bytes,
            recomputed_ops=ops[label] - ops[ref],
            time_ratio=statistics.median(times[label]) / ref_time,
            checkpoint_ratio=statistics.median(times[label]) / ckpt_time,
            grad_diff=max(
                (a - b).abs().max().item() for a, b in zip(grads[label], grads[ref], strict=True)
            ),
        )
        for label, how in variants
    ]


def format_table(rows: Sequence[Row]) -> str:
    """Format rows as a Markdown table.

    Examples:
        >>> table = format_table([Row("no remat", 2048, 1024, 0, 1.0, 0.0, 0.5)])
        >>> [cell.strip() for cell in table.splitlines()[2].split("|")[1:-1]]
        ['no remat', '2,048', '1,024', '0', '1.00x', '0.50x', 'yes']
    """
    header = ("policy", "peak bytes", "held bytes", "recomputed ops", "time vs no remat",
              "vs torch checkpoint", "grads match")
    cells = [header] + [
        (r.label, f"{r.peak_bytes:,}", f"{r.held_bytes:,}", f"{r.recomputed_ops:,}",
         f"{r.time_ratio:.2f}x", f"{r.checkpoint_ratio:.2f}x",
         "yes" if r.grads_match else f"NO ({r.grad_diff:.1e})")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        # Text columns left-aligned, numbers right-aligned.
        parts = [c.ljust(w) if i in (0, 6) else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "| " + " | ".join(parts) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def main(argv: Sequence[str] | None = None) -> list[Row]:
    """Run the demo and print its table; return the rows.

    Args:
        argv (sequence of str, optional): command-line arguments (``--depth``,
            ``--width``, ``--heads``, ``--batch``, ``--seq``, ``--repeats``,
            ``--threads``). Default: ``sys.argv[1:]``.

    Returns:
        list[Row]: one row per variant, no remat first.
    """
    args = _parser().parse_args(argv)
    model = demo.Stack(depth=args.depth, width=args.width, heads=args.heads)
    x = demo.make_input(model, batch=args.batch, seq=args.seq)
    # One thread: on a shared, loaded machine several threads per op make timings noise.
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = run(model, x, repeats=args.repeats)
    finally:
        torch.set_num_threads(threads)
    print(f"GPT-style stack: {args.depth} blocks, width {args.width}, {args.heads} heads, "
          f"input ({args.batch}, {args.seq}, {args.width}), float32, CPU; "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")
    print(format_table(rows))
    print("peak/held: bytes of tensor storages beyond parameters and input, counted exactly.\n"
          "recomputed ops: aten compute ops in backward minus those of no remat's backward.")
    print(SIZE_NOTE)
    return rows


#: (option, default, help) of the command line, in ``--help`` order.
_OPTIONS: tuple[tuple[str, int, str], ...] = (
    ("depth", 8, "number of transformer blocks in the stack"),
    ("width", demo.DEMO_WIDTH, "model width (embedding size) of every block"),
    ("heads", 4, "attention heads per block (must divide --width)"),
    ("batch", 4, "sequences per training step"),
    ("seq", demo.DEMO_SEQ, "tokens per sequence"),
    ("repeats", 7, "timed repetitions per variant, interleaved; times are their medians"),
    ("threads", 1, "torch CPU threads while it runs (1 keeps timings steady on a busy machine)"),
)


def _parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        prog="python -m remat",
        description=doc.splitlines()[0].replace("``", ""),
        epilog=(
            "Memory is exact (tensor storages, parameters and input excluded); times are "
            "ratios measured in this run. Example: python -m remat --depth 4 --repeats 3"
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for name, default, text in _OPTIONS:
        parser.add_argument(f"--{name}", type=int, default=default, metavar="N", help=text)
    return parser


if __name__ == "__main__":
    main()
