"""Each remat policy's step time as a ratio to its torch equivalent, across widths.

On the GPT-style stack (``remat._demo_model.Stack``, 8 blocks, one torch thread)
at widths 64, 128, 256 and 512, and at the demo's size (width 256, seq 128), one
training step (forward and backward of a mean-square loss) is timed for each
pair, side by side in one run, repetitions interleaved in a rotating order:

- ``nothing-saveable`` against ``torch.utils.checkpoint`` (non-reentrant) per block;
- ``dots-saveable`` against torch selective checkpointing saving the dots ops;
- ``dots-no-batch-saveable`` against selective checkpointing saving the 2-D dots ops;
- ``save-last`` against ``torch.utils.checkpoint`` of all blocks but the last
  (what save-last does by hand), and against full checkpointing.

A ratio below 1 means remat's step is faster. Peak bytes of one step (exact:
tensor storages beyond parameters and input) are printed beside, so that a
faster row is not a row that holds more. A small width is where a fixed cost
per op or per hook call shows: at width 512 the matmuls hide it.

    python benchmarks/width_sweep.py --repeats 21

Prints a Markdown table and writes ``benchmarks/width_sweep.json``. These are
measurements, not tests: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from remat import _demo_model as demo
from remat import measure_memory

#: Checkpointing all blocks of the stack but the last (torch's by-hand save-last).
ALL_BUT_LAST = "torch checkpoint, all but the last block"

#: (remat policy, its torch equivalents): the first equivalent is the ratio's reference.
PAIRS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nothing-saveable", (demo.TORCH_CHECKPOINT,)),
    ("dots-saveable", (demo.TORCH_SELECTIVE + "dots-saveable",)),
    ("dots-no-batch-saveable", (demo.TORCH_SELECTIVE + "dots-no-batch-saveable",)),
    ("save-last", (ALL_BUT_LAST, demo.TORCH_CHECKPOINT)),
)

#: The demo's size (``python -m remat``), chosen by this sweep (`demo.DEMO_WIDTH`).
DEMO = {"width": demo.DEMO_WIDTH, "seq": demo.DEMO_SEQ}


def loss_fn(model: demo.Stack, how: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """One step's loss under ``how`` (a `Stack` checkpointing string or `ALL_BUT_LAST`)."""
    if how != ALL_BUT_LAST:
        return lambda x: model.loss(x, how)

    def all_but_last(x: torch.Tensor) -> torch.Tensor:
        *rest, last = model.blocks
        for block in rest:
            x = checkpoint(block, x, use_reentrant=False)
        out: torch.Tensor = last(x).pow(2).mean()
        return out

    return all_but_last


def _step_seconds(model: demo.Stack, loss: Callable[[torch.Tensor], torch.Tensor],
                  x: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    start = time.process_time()  # CPU time: a loaded machine's waits do not count
    loss(x).backward()
    return time.process_time() - start


def measure(width: int, seq: int, depth: int, batch: int, heads: int,
            repeats: int) -> dict[str, Any]:
    """Step times (medians) and peaks of every variant at one size, interleaved."""
    model = demo.Stack(depth=depth, width=width, heads=heads)
    x = demo.make_input(model, batch=batch, seq=seq)
    variants = list(dict.fromkeys(
        how for policy, torch_ones in PAIRS for how in (policy, *torch_ones)
    ))
    losses = {how: loss_fn(model, how) for how in variants}
    peaks = {}
    for how in variants:  # also the warm-up: the policies resolve, the runners are built
        model.zero_grad(set_to_none=True)
        peaks[how] = measure_memory(losses[how], x).peak_bytes
    times: dict[str, list[float]] = collections.defaultdict(list)
    for rep in range(repeats):
        shift = rep % len(variants)  # a rotating order: no variant always runs first
        for how in variants[shift:] + variants[:shift]:
            times[how].append(_step_seconds(model, losses[how], x))
    medians = {how: statistics.median(ts) for how, ts in times.items()}
    rows = []
    for policy, torch_ones in PAIRS:
        for reference in torch_ones:
            rows.append({
                "width": width, "seq": seq, "policy": policy, "torch": reference,
                "ratio": medians[policy] / medians[reference],
                "peak_bytes": peaks[policy], "torch_peak_bytes": peaks[reference],
            })
    return {"rows": rows, "seconds": medians}


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table.

    Examples:
        >>> row = {"width": 64, "seq": 64, "policy": "nothing-saveable",
        ...        "torch": "torch-checkpoint", "ratio": 0.98, "peak_bytes": 2048,
        ...        "torch_peak_bytes": 2048}
        >>> markdown([row]).splitlines()[2]
        '| 64 | 64 | nothing-saveable | torch-checkpoint | 0.980x | 2,048 | 2,048 |'
    """
    lines = ["| width | seq | remat policy | torch equivalent | remat / torch step time "
             "| remat peak bytes | torch peak bytes |",
             "|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['width']} | {r['seq']} | {r['policy']} | {r['torch']} | {r['ratio']:.3f}x "
            f"| {r['peak_bytes']:,} | {r['torch_peak_bytes']:,} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (the sweep)")
    parser.add_argument("--demo-seq", type=int, default=DEMO["seq"],
                        help="tokens per sequence of the demo-size rows")
    parser.add_argument("--demo-width", type=int, default=DEMO["width"])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=21, help="interleaved repetitions")
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).with_name("width_sweep.json"))
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the sweep and the demo-size row; print the table, write the JSON, return both."""
    args = _parser().parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: several per op make timings noise on a busy box
    try:
        sizes = [(width, args.seq) for width in args.widths]
        if (args.demo_width, args.demo_seq) not in sizes:  # the demo's size, once
            sizes.append((args.demo_width, args.demo_seq))
        rows = []
        for width, seq in sizes:
            rows.extend(measure(width, seq, args.depth, args.batch, args.heads,
                                args.repeats)["rows"])
    finally:
        torch.set_num_threads(threads)
    table = markdown(rows)
    print(f"{args.depth} blocks, batch {args.batch}, {args.heads} heads, float32, CPU, one "
          f"thread; medians of {args.repeats} interleaved steps (CPU time); the demo's "
          f"size (python -m remat): width {args.demo_width}, seq {args.demo_seq}")
    print(table)
    result = {"config": vars(args) | {"out": str(args.out)}, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
