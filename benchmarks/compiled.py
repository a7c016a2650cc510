"""Benchmark remat's lowered policies under ``torch.compile`` against torch's own checkpointing.

On the GPT-style block stack of ``bench.py`` (``remat._demo_model.Stack``),
compiled whole, it measures per variant: the bytes the compiled forward graph
saves for the compiled backward graph (exact: the sizes of the forward
graph's saved outputs, from the graph's own metadata), how many matmuls the
backward graph runs (gradients plus recomputed ones), one training step's time
as a ratio to the compiled stack without remat (median of interleaved
repetitions), and the largest gradient difference from no remat.

Variants: no remat, ``torch.utils.checkpoint`` per block, torch selective
checkpointing saving the dots, and the remat policies that lower
(``docs/compile.md``).

Run: ``python benchmarks/compiled.py`` (``--help`` for sizes). The backend is
``aot_eager``: AOTAutograd's graphs, run as traced, so the columns show the
partitioner's choices, not a code generator's. Prints a Markdown table and
returns the results; nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from remat import _demo_model as demo

VARIANTS = (
    ("no remat", demo.NO_REMAT),
    ("torch checkpoint", demo.TORCH_CHECKPOINT),
    ("torch selective (dots ops)", demo.TORCH_SELECTIVE + "dots-saveable"),
    ("remat nothing-saveable", "nothing-saveable"),
    ("remat dots-saveable", "dots-saveable"),
    ("remat dots-no-batch-saveable", "dots-no-batch-saveable"),
)
MATMULS = {"aten.mm.default", "aten.bmm.default", "aten.addmm.default"}


def saved(forward: torch.fx.GraphModule, user_outputs: int) -> tuple[int, int]:
    """What the forward graph saves for backward (its outputs beyond the user's).

    Returns the bytes of the saved tensors of known size, and how many random
    states it saves (a recomputed random op's generator state, whose size the
    graph leaves symbolic: 5,056 bytes each for the CPU generator).
    """
    inputs = {node for node in forward.graph.nodes if node.op == "placeholder"}
    (output,) = [node for node in forward.graph.nodes if node.op == "output"]
    total, states = 0, 0
    for node in output.args[0][user_outputs:]:
        value = getattr(node, "meta", {}).get("val")
        if node in inputs or not isinstance(value, torch.Tensor):  # inputs cost nothing more
            continue
        if isinstance(value.numel(), int):
            total += value.numel() * value.element_size()
        else:
            states += 1
    return total, states


class Capture:
    """An ``aot_eager`` backend that keeps the forward and backward graphs it compiles."""

    def __init__(self) -> None:
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []

        def keep(graphs: list[torch.fx.GraphModule]) -> Callable[..., Any]:
            def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
                graphs.append(gm)
                return make_boxed_func(gm)  # run as traced

            return compiler

        self.backend = aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward))


def compiled_step(
    model: demo.Stack, x: torch.Tensor, checkpointing: str
) -> tuple[Callable[[torch.Tensor], torch.Tensor], dict[str, Any]]:
    """Compile ``model.loss`` under ``checkpointing`` and run one training step.

    Returns the compiled loss and what its graphs did: how many forward graphs,
    the bytes and random states they save for backward (`saved`), the backward's
    matmuls, and the gradients.
    """
    model.loss(x, checkpointing)  # build the variant's wrappers before Dynamo traces
    capture = Capture()
    loss = torch.compile(own_code(model, checkpointing), backend=capture.backend, dynamic=False)
    model.zero_grad(set_to_none=True)
    loss(x).backward()
    kept = [saved(gm, 1) for gm in capture.forward]
    return loss, {
        "graphs": len(capture.forward),
        "saved_bytes": sum(k[0] for k in kept),
        "saved_random_states": sum(k[1] for k in kept),
        "backward_matmuls": sum(
            str(node.target) in MATMULS for gm in capture.backward for node in gm.graph.nodes
        ),
        "grads": [p.grad.clone() for p in model.parameters() if p.grad is not None],
    }


def measure(model: demo.Stack, x: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    """Compile each variant once, then time interleaved repetitions."""
    steps, rows = {}, {}
    torch._dynamo.reset()
    for label, checkpointing in VARIANTS:
        steps[label], row = compiled_step(model, x, checkpointing)
        rows[label] = {"variant": label} | row
    times: dict[str, list[float]] = {label: [] for label in steps}
    labels = list(steps)
    for r in range(repeats):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            model.zero_grad(set_to_none=True)
            times[label].append(_seconds(steps[label], x))
    reference = rows["no remat"]["grads"]
    median = {label: statistics.median(ts) for label, ts in times.items()}
    for label, row in rows.items():
        grads = row.pop("grads")
        row["max_grad_diff"] = max(
            (a - b).abs().max().item() for a, b in zip(grads, reference, strict=True)
        )
        row["time_vs_none"] = median[label] / median["no remat"]
    return list(rows.values())


def own_code(model: demo.Stack, checkpointing: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model.loss(x, checkpointing)`` as a function with a code object of its own.

    Dynamo keeps compiled code per code object and checks each entry's guards
    in turn: variants sharing one would pay for the guards of those compiled
    before them.
    """

    def loss(x: torch.Tensor) -> torch.Tensor:
        return model.loss(x, checkpointing)

    return types.FunctionType(
        loss.__code__.replace(), loss.__globals__, loss.__name__, None, loss.__closure__
    )


def _seconds(loss: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    """One training step's wall time (CPU: no device to synchronize)."""
    start = time.perf_counter()
    loss(x).backward()
    return time.perf_counter() - start


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    none = rows[0]["saved_bytes"]
    lines = [
        "| variant | saved for backward (bytes) | vs no remat | random states saved "
        "| backward matmuls | time vs no remat | max grad diff |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['variant']} | {row['saved_bytes']:,} | {row['saved_bytes'] / none:.3f} "
            f"| {row['saved_random_states']} | {row['backward_matmuls']} "
            f"| {row['time_vs_none']:.2f}x "
            f"| {row['max_grad_diff']:.1e} |"
        )
    return "\n".join(lines)


def sized_stack(
    doc: str | None,
    sizes: dict[str, int],
    small_sizes: dict[str, int],
    argv: Sequence[str] | None,
    small: bool,
) -> tuple[argparse.Namespace, demo.Stack, torch.Tensor, dict[str, Any]]:
    """The command line of a compiled-stack benchmark: its sizes, the stack and its input.

    ``sizes`` are the defaults (``small_sizes`` replace them with ``small``); each
    is an ``--option``. Returns the parsed arguments, the stack, its input and
    the configuration to report.
    """
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    defaults = sizes | small_sizes if small else sizes
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args([] if argv is None and small else argv)
    torch.set_num_threads(1)
    model = demo.Stack(depth=args.depth, width=args.width, heads=args.heads)
    x = demo.make_input(model, batch=args.batch, seq=args.seq)
    config = {k: getattr(args, k) for k in defaults} | {"backend": "aot_eager"}
    return args, model, x, config


def report(config: dict[str, Any], table: str) -> None:
    print(f"GPT-style stack {config}, float32, torch {torch.__version__}, {sys.platform}")
    print(table)


def main(argv: Sequence[str] | None = None, small: bool = False) -> dict[str, Any]:
    """Run the benchmark and print the table; return the results."""
    args, model, x, config = sized_stack(
        __doc__,
        {"depth": 8, "width": 128, "heads": 4, "batch": 8, "seq": 128, "repeats": 7},
        {"depth": 2, "width": 16, "heads": 2, "batch": 2, "seq": 8, "repeats": 1},
        argv,
        small,
    )
    rows = measure(model, x, args.repeats)
    report(config, markdown(rows))
    return {"config": config, "rows": rows}


if __name__ == "__main__":
    main()
