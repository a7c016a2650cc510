"""Benchmark remat's policies against the tools users would otherwise pick.

On a GPT-style block stack (``remat._demo_model.Stack``) it measures one
training step (forward + backward of a mean-square loss) under: no
checkpointing, ``torch.utils.checkpoint`` (non-reentrant) per block, torch
selective checkpointing saving the ops remat's dots policies save,
``checkpoint_sequential`` (one segment per block), and every remat policy.

Per variant: device peak and held bytes (exact on CPU: tensor storages beyond
parameters and input, counted by ``remat.measure_memory``), host bytes (the
host store's pooled buffers; offload policies only), step time as
a ratio to no remat and to ``torch.utils.checkpoint`` measured in the same run
(median over repetitions, variants interleaved in a rotating order), and the
largest gradient difference from no remat. Then it shows that
``torch.utils.checkpoint`` raises under ``torch.func.grad`` while remat runs.

Offload on CPU: the default (CUDA) store takes no CPU tensor, so
``remat offload-dots`` degrades to saving (0 host bytes). The row
``remat offload-dots (fake host store, CPU simulation)`` (``--no-fake-offload``
to drop it) runs the same policy with ``FakeHostStore(min_bytes=0)``, which
copies CPU to CPU: it shows the protocol's effect on the byte columns (device
bytes drop, host bytes appear; values fetched back in backward count as device
memory again), not real transfer costs; its time includes plain CPU copies.
On CUDA the same columns come from the real pinned store.

Run: ``python benchmarks/bench.py`` (``--help`` for sizes); writes
``benchmarks/results.json`` and prints a Markdown table. These are
measurements, not tests: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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

from remat import MemoryReport
from remat import _demo_model as demo
from remat import measure_memory as measure_step
from remat._inspect.memory import MemoryMeter
from remat._offload.cuda import CudaHostStore
from remat._offload.fake import FakeHostStore
from remat._offload.selection import use_host_store
from remat._offload.store import HostStore

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
FAKE_OFFLOAD = "remat offload-dots (fake host store, CPU simulation)"


@dataclasses.dataclass
class Row:
    """One variant's measurements."""

    variant: str
    peak_bytes: int
    held_bytes: int
    host_bytes: int
    time_vs_none: float
    time_vs_torch: float
    max_grad_diff: float


class MeteredFakeStore(FakeHostStore):
    """`FakeHostStore` whose values brought back count as device memory in ``meter``.

    The engines call stores with dispatch modes disabled, so a `MemoryMeter`
    sees neither the host copies (right: they are host memory) nor the values
    fetched back in backward (wrong: on a GPU those are device allocations).
    This store reports the latter to the meter of the step being measured.
    """

    def __init__(self) -> None:
        super().__init__(min_bytes=0)
        self.meter: MemoryMeter | None = None

    def _count(self, t: torch.Tensor | None) -> None:
        if self.meter is not None and t is not None:
            self.meter._track(t.untyped_storage(), baseline=False)

    def prefetch(self, handle: int) -> None:
        super().prefetch(handle)
        self._count(self.fetched.get(handle))

    def get(self, handle: int) -> torch.Tensor:
        value = super().get(handle)
        self._count(value)
        return value


def with_store(
    loss: Callable[[torch.Tensor], torch.Tensor], store: HostStore
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``loss`` with its regions' offloaded values sent to ``store``."""

    def run(x: torch.Tensor) -> torch.Tensor:
        with use_host_store(store):
            return loss(x)

    return run


def measure_with_meter(
    loss: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, store: MeteredFakeStore
) -> MemoryReport:
    """`remat.measure_memory` on CPU, counting what ``store`` brings back as device bytes."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with MemoryMeter() as meter:
            store.meter = meter
            meter.add_baseline(x)
            out = loss(x)
            held, baseline = meter.current, meter.baseline
            out.backward()
            del out
            return MemoryReport(meter.peak, held, baseline)
    finally:
        store.meter = None
        if was_enabled:
            gc.enable()


def make_losses(
    model: demo.Stack, stores: dict[str, HostStore] | None = None, fake_offload: bool = True
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every variant as a function from the input to the scalar loss.

    Offload variants get a store of their own, recorded in ``stores`` by label.
    """
    stores = {} if stores is None else stores
    losses: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for label, how in TORCH_VARIANTS:
        losses[label] = lambda x, how=how: model.loss(x, how)

    def sequential(x: torch.Tensor) -> torch.Tensor:
        blocks = list(model.blocks)
        out = tuc.checkpoint_sequential(blocks, len(blocks), x, use_reentrant=False)
        return out.pow(2).mean()

    losses[SEQUENTIAL] = sequential
    for policy in REMAT_POLICIES:
        label = f"remat {policy}"
        losses[label] = lambda x, how=policy: model.loss(x, how)
        if policy.startswith("offload"):
            # A store per variant, so its host bytes are this variant's alone.
            stores[label] = CudaHostStore()
            losses[label] = with_store(losses[label], stores[label])
            if fake_offload:
                stores[FAKE_OFFLOAD] = MeteredFakeStore()
                losses[FAKE_OFFLOAD] = with_store(
                    lambda x, how=policy: model.loss(x, how), stores[FAKE_OFFLOAD]
                )
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
    synchronize(x.device)
    start = time.perf_counter()
    loss(x).backward()
    synchronize(x.device)  # CUDA runs asynchronously: time the work, not its launch
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def progress(done: int, total: int, what: str) -> None:
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def measure(
    model: demo.Stack, x: torch.Tensor, repeats: int, fake_offload: bool = True
) -> list[Row]:
    """Memory and gradients once per variant, then interleaved timed repetitions."""
    stores: dict[str, HostStore] = {}
    losses = make_losses(model, stores, fake_offload)
    labels = list(losses)
    total = len(labels) * (1 + repeats)
    memory, grads, host = {}, {}, {}
    for i, label in enumerate(labels):
        progress(i, total, label)
        model.zero_grad(set_to_none=True)
        store = stores.get(label)
        if isinstance(store, MeteredFakeStore):
            memory[label] = measure_with_meter(losses[label], x, store)
        else:
            memory[label] = measure_step(losses[label], x)
        # Pooled host buffers after one fresh step: what it offloaded at most at once.
        host[label] = store.host_bytes if store is not None else 0
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
            host[label],
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


def offload_summary(rows: Sequence[Row]) -> str:
    """``offload-dots`` against ``dots-saveable``: the trade the offload policy makes."""
    by_label = {r.variant: r for r in rows}
    saved, offloaded = by_label["remat dots-saveable"], by_label["remat offload-dots"]
    time = offloaded.time_vs_none / saved.time_vs_none
    return (
        f"offload-dots vs dots-saveable: step time {time:.2f}x, "
        f"device peak {offloaded.peak_bytes / saved.peak_bytes:.2f}x, "
        f"host bytes {offloaded.host_bytes:,}"
    )


def markdown(rows: Sequence[Row]) -> str:
    """The Markdown table of the results."""
    header = (
        "variant",
        "device peak bytes",
        "device held bytes",
        "host bytes",
        "time / no remat",
        "time / torch checkpoint",
        "max grad diff",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * 6) + "|"]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.peak_bytes:,} | {r.held_bytes:,} | {r.host_bytes:,} | "
            f"{r.time_vs_none:.2f}x | {r.time_vs_torch:.2f}x | {r.max_grad_diff:.1e} |"
        )
    return "\n".join(lines)


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
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
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument(
        "--fake-offload",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CPU, add the offload-dots row with a CPU-to-CPU fake host store",
    )
    parser.add_argument("--json", default=str(pathlib.Path(__file__).with_name("results.json")))
    args = parser.parse_args([] if argv is None and small else argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = demo.Stack(depth=args.depth, width=args.width, heads=args.heads).to(device)
    x = demo.make_input(model, batch=args.batch, seq=args.seq).to(device)
    rows = measure(model, x, args.repeats, args.fake_offload and device.type == "cpu")
    func = under_torch_func_grad(model, x)
    config = {k: getattr(args, k) for k in defaults} | {"device": args.device}
    print(f"GPT-style stack {config}, float32; {machine(device)}")
    print(markdown(rows))
    offload = offload_summary(rows)
    print(f"\n{offload}")
    print("\nUnder torch.func.grad:")
    for label, what in func.items():
        print(f"- {label}: {what}")
    results = {
        "config": config,
        "machine": machine(device),
        "rows": [dataclasses.asdict(r) for r in rows],
        "offload": offload,
        "torch_func_grad": func,
    }
    if not small:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
