"""The memory-budget Pareto curve: held bytes and recompute for budgets vs every hand policy.

Two models, each block its own region: the benchmark model
(``remat._demo_model.Stack``) and a tiny random-init Hugging Face Llama (every
decoder layer wrapped with ``remat.apply``). Per variant, one training step:

- **held** and **peak** bytes: exact, ``remat.measure_memory`` (after a first
  step, so a budget's plan is made);
- **backward FLOPs**: torch's FLOP formulas (``flop_registry``) around the
  backward (matmuls and attention: gradients plus what the recompute reruns);
- **recompute cost**: the planner's estimate (FLOPs + bytes moved) summed over
  the ops the backward reruns, counted;
- **time**: median of interleaved repetitions, as a ratio to no remat (same run);
- **max grad diff** from no remat.

Budgets ``budget:F`` for F in 0, 0.1, 0.2, 0.3, 0.5, 0.7, 1, and ``budget = P``:
a budget of exactly the bytes hand policy P holds per block. For the demo model
it also compiles the stack (``backend="aot_eager"``) with torch's
``torch._functorch.config.activation_memory_budget`` at the same fractions and
reads what the compiled forward graph saves (``compiled.saved``), beside remat's
budgets lowered into the same compiled graph (each planned by one eager step).

Run: ``python benchmarks/budget_pareto.py`` (``--help`` for sizes); ``--plot
FILE.png`` draws the curves when matplotlib is installed. Nothing here asserts
on time.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

import remat
from remat import _demo_model as demo
from remat._policy.op_cost import op_cost
from remat._replay.checks import arg_shapes

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from compiled import Capture, own_code, saved

FRACTIONS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
HAND = (
    "nothing-saveable",
    "dots-no-batch-saveable",
    "dots-saveable",
    "save:attn_out",
    "save:mlp_hidden",
    "everything-saveable",
)
LLAMA_HAND = ("nothing-saveable", "dots-no-batch-saveable", "dots-saveable", "everything-saveable")

Step = Callable[[], torch.Tensor]


class Flops(torch.utils._python_dispatch.TorchDispatchMode):
    """FLOPs of matmuls and attention, by torch's formulas (``flop_registry``).

    Not ``FlopCounterMode``: its module tracker adds a forward pre-hook whose
    ``view_as`` runs inside a region's recompute only (the mode was entered
    around the backward), and remat's determinism check rightly refuses a
    recompute that runs an op its forward did not.
    """

    #: A compiled backward replays random ops in ``run_with_rng_state``: run it as is
    #: (its dropout is no matmul).
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(getattr(func, "overloadpacket", None))
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


class _RecomputeCost(torch.utils._python_dispatch.TorchDispatchMode):
    """The planner's cost estimate over the ops the backward reruns (stand-ins excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.cost = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [t for t in outs if isinstance(t, torch.Tensor)]
        if remat.is_recomputing() and not any(t.is_meta for t in tensors):
            self.cost += op_cost(
                func, arg_shapes(args, kwargs), [(t.shape, t.dtype) for t in tensors]
            )
        return out


def _measure(step: Step, params: Sequence[torch.nn.Parameter]) -> dict[str, Any]:
    for p in params:
        p.grad = None
    step().backward()  # the first call plans a budget
    for p in params:
        p.grad = None
    report = remat.measure_memory(step)
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    loss = step()
    with Flops() as flops, _RecomputeCost() as cost:
        loss.backward()
    return {
        "held_bytes": report.held_bytes,
        "peak_bytes": report.peak_bytes,
        "backward_flops": flops.total,
        "recompute_cost": cost.cost,
        "grads": grads,
    }


def _time(steps: dict[str, Step], repeats: int) -> dict[str, float]:
    labels = list(steps)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(repeats):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            start = time.perf_counter()
            steps[label]().backward()
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(ts) for label, ts in times.items()}


def _finish(
    rows: dict[str, dict[str, Any]], steps: dict[str, Step], repeats: int
) -> list[dict[str, Any]]:
    median = _time(steps, repeats)
    reference = rows["no remat"].pop("grads")
    for label, row in rows.items():
        grads = row.pop("grads", reference)
        row["variant"] = label
        row["max_grad_diff"] = max(
            (a - b).abs().max().item() for a, b in zip(grads, reference, strict=True)
        )
        row["time_vs_none"] = median[label] / median["no remat"]
    return list(rows.values())


# -- the benchmark model ----------------------------------------------------------


def demo_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    model = demo.Stack(depth=args.depth, width=args.width, heads=args.heads)
    x = demo.make_input(model, batch=args.batch, seq=args.seq)
    params = list(model.parameters())
    block_input = torch.randn(args.batch, args.seq, args.width)
    variants: list[tuple[str, Any]] = [("no remat", demo.NO_REMAT)]
    variants += [(f"remat {p}", p) for p in HAND]
    variants += [(f"budget:{f}", f"budget:{f}") for f in FRACTIONS]
    for hand in HAND[1:-1]:  # a budget of exactly what the hand policy holds per block
        held = remat.residual_totals(
            remat.saved_residuals(model.blocks[0], block_input, policy=hand)
        )
        variants.append(
            (
                f"budget = {hand} ({held['saved']:,} B/block)",
                remat.policies.memory_budget(bytes=held["saved"]),
            )
        )
    rows, steps = {}, {}
    for label, checkpointing in variants:
        step = _demo_step(model, x, checkpointing)
        rows[label], steps[label] = _measure(step, params), step
    return _finish(rows, steps, args.repeats)


def _demo_step(model: demo.Stack, x: torch.Tensor, checkpointing: Any) -> Step:
    if isinstance(checkpointing, str):
        return lambda: model.loss(x, checkpointing)
    blocks = [remat.remat(b, policy=checkpointing) for b in model.blocks]

    def step() -> torch.Tensor:
        h = x
        for block in blocks:
            h = block(h)
        return h.pow(2).mean()

    return step


def compiled_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Compiled (``aot_eager``), same stack: torch's compile-only budget, and remat's budget
    lowered into the graph (planned by one eager step first). Bytes the compiled forward
    saves for the backward graph; matmul and attention FLOPs of the backward."""
    model = demo.Stack(depth=args.depth, width=args.width, heads=args.heads)
    x = demo.make_input(model, batch=args.batch, seq=args.seq)
    rows = []
    variants = [(f"torch activation_memory_budget={f}", demo.NO_REMAT, f) for f in FRACTIONS]
    variants += [(f"remat budget:{f} (lowered)", f"budget:{f}", 1.0) for f in FRACTIONS]
    for label, checkpointing, fraction in variants:
        if checkpointing != demo.NO_REMAT:
            model.loss(x, checkpointing).backward()  # the eager step that plans
        torch._dynamo.reset()
        capture = Capture()
        loss = torch.compile(own_code(model, checkpointing), backend=capture.backend, dynamic=False)
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            model.zero_grad(set_to_none=True)
            out = loss(x)  # compiled (and partitioned under the budget) here
        with Flops() as flops:
            out.backward()
        start = time.perf_counter()
        for _ in range(args.repeats):
            loss(x).backward()
        rows.append(
            {
                "variant": label,
                "saved_bytes": sum(saved(gm, 1)[0] for gm in capture.forward),
                "graphs": len(capture.forward),
                "backward_flops": flops.total,
                "seconds": (time.perf_counter() - start) / max(args.repeats, 1),
            }
        )
    base = rows[len(FRACTIONS) - 1]["seconds"]
    for row in rows:
        row["time_vs_budget_1"] = row.pop("seconds") / base
    return rows


# -- a tiny Hugging Face Llama ------------------------------------------------------


def llama_rows(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    try:
        import transformers
    except ImportError:
        return None
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=args.width,
        intermediate_size=2 * args.width,
        num_hidden_layers=2,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=2 * args.seq,
        use_cache=False,
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    rows, steps = {}, {}
    variants = [
        ("no remat", None),
        *[(f"remat {p}", p) for p in LLAMA_HAND],
        *[(f"budget:{f}", f"budget:{f}") for f in FRACTIONS],
    ]
    for label, policy in variants:
        model = copy.deepcopy(base)
        if policy is not None:
            remat.apply(model, policy=policy, where=layer)
        params = list(model.parameters())

        def step(model: Any = model) -> torch.Tensor:
            return model(ids, labels=ids).loss  # type: ignore[no-any-return]

        rows[label], steps[label] = _measure(step, params), step
    return _finish(rows, steps, args.repeats)


# -- output ---------------------------------------------------------------------------


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    none = rows[0]
    lines = [
        "| variant | held bytes | vs no remat | peak bytes | backward FLOPs | recompute cost "
        "| time vs no remat | max grad diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['variant']} | {row['held_bytes']:,} "
            f"| {row['held_bytes'] / none['held_bytes']:.3f} "
            f"| {row['peak_bytes']:,} | {row['backward_flops']:,} | {row['recompute_cost']:,} "
            f"| {row['time_vs_none']:.2f}x | {row['max_grad_diff']:.1e} |"
        )
    return "\n".join(lines)


def compiled_markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| variant | saved bytes (compiled forward) | graphs | backward FLOPs "
        "| time vs torch budget 1 |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['variant']} | {row['saved_bytes']:,} | {row['graphs']} "
            f"| {row['backward_flops']:,} | {row['time_vs_budget_1']:.2f}x |"
        )
    return "\n".join(lines)


def dominated(rows: Sequence[dict[str, Any]]) -> list[str]:
    """For each hand policy: the budget rows that hold no more and recompute no more."""
    budgets = [r for r in rows if r["variant"].startswith("budget")]
    out = []
    for hand in (r for r in rows if r["variant"].startswith("remat ")):
        better = [
            b["variant"]
            for b in budgets
            if b["held_bytes"] <= hand["held_bytes"]
            and b["recompute_cost"] <= hand["recompute_cost"]
        ]
        out.append(
            f"- {hand['variant']}: matched or beaten by {', '.join(better) or 'no budget row'}"
        )
    return out


def plot(results: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("demo", "llama"), strict=True):
        rows = results.get(key) or []
        budget = [r for r in rows if r["variant"].startswith("budget:")]
        ax.plot(
            [r["held_bytes"] for r in budget],
            [r["recompute_cost"] for r in budget],
            "o-",
            label="budget:F",
        )
        for r in rows:
            if r["variant"].startswith("remat "):
                ax.plot(r["held_bytes"], r["recompute_cost"], "x")
                ax.annotate(r["variant"][6:], (r["held_bytes"], r["recompute_cost"]), fontsize=7)
        ax.set_xlabel("held bytes")
        ax.set_ylabel("recompute cost (FLOPs + bytes)")
        ax.set_title(key)
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def main(argv: Sequence[str] | None = None, small: bool = False) -> dict[str, Any]:
    """Run the benchmark and print the tables; return the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = {"depth": 4, "width": 64, "heads": 4, "batch": 4, "seq": 64, "repeats": 5}
    if small:
        defaults |= {"depth": 2, "width": 16, "heads": 2, "batch": 2, "seq": 8, "repeats": 1}
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args([] if argv is None and small else argv)
    torch.set_num_threads(1)
    config = {k: getattr(args, k) for k in defaults}
    results: dict[str, Any] = {"config": config, "demo": demo_rows(args)}
    print(f"Benchmark model {config}, float32, torch {torch.__version__}, {sys.platform}")
    print(markdown(results["demo"]))
    print("\n".join(dominated(results["demo"])))
    results["llama"] = llama_rows(args)
    if results["llama"] is not None:
        print("\nTiny Llama (2 layers, each a region):")
        print(markdown(results["llama"]))
        print("\n".join(dominated(results["llama"])))
    if not args.no_compile:
        results["compiled"] = compiled_rows(args)
        print("\ntorch.compile(backend='aot_eager') with activation_memory_budget, same model:")
        print(compiled_markdown(results["compiled"]))
    if args.plot and not plot(results, args.plot):
        print("(matplotlib is not installed: no plot)")
    return results


if __name__ == "__main__":
    main()
