"""Instructions and Python calls per training step, per remat policy and its torch
equivalents (issue 17: the eager engine's fixed per-step cost).

Time on a loaded machine is noise; instruction counts are not. Each variant runs
in its own process under callgrind collecting nothing until the measured
steps begin (``torch._C._valgrind_toggle`` around them), so imports, model
construction and two warm-up steps are not counted. The same steps run again
under cProfile for the number of Python function calls per step.

    python benchmarks/instructions.py                 # every variant, both measures
    python benchmarks/instructions.py --steps 2 --variants save-last torch-checkpoint
    python benchmarks/instructions.py --no-callgrind  # call counts only (no valgrind)

Variants: a `remat._demo_model.Stack` checkpointing string (a remat policy,
``torch-checkpoint``, ``torch-selective:dots-saveable``, ``none``) or
``torch-all-but-last`` (torch's checkpoint on every block but the last: what
``save-last`` does by hand). The model is the 8-block stack at width 16, seq 8,
batch 4, one torch thread: small, so that a fixed cost per op or per hook
shows. Prints a Markdown table; these are measurements, nothing here asserts.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import os
import pathlib
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch

from remat import _demo_model as demo

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or loaded
import width_sweep as sweep

ALL_BUT_LAST = "torch-all-but-last"

#: (remat policy, its torch equivalent): the rows of the table.
PAIRS: tuple[tuple[str, str], ...] = (
    ("nothing-saveable", demo.TORCH_CHECKPOINT),
    ("dots-saveable", demo.TORCH_SELECTIVE + "dots-saveable"),
    ("dots-no-batch-saveable", demo.TORCH_SELECTIVE + "dots-no-batch-saveable"),
    ("save-last", ALL_BUT_LAST),
)


def loss_fn(model: demo.Stack, variant: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """One step's loss: a `Stack` checkpointing string, or torch's all-but-last
    (``width_sweep.py``'s, under this script's shorter name)."""
    return sweep.loss_fn(model, sweep.ALL_BUT_LAST if variant == ALL_BUT_LAST else variant)


def _stepper(variant: str, width: int, seq: int, batch: int) -> Callable[[], None]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = demo.Stack(depth=8, width=width, heads=2)
    x = demo.make_input(model, batch=batch, seq=seq).requires_grad_()
    loss = loss_fn(model, variant)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss(x).backward()

    step()  # warm: policies resolve, caches fill
    step()
    return step


def child(variants: list[str], steps: int, width: int, seq: int, batch: int,
          mode: str) -> None:
    """Run ``steps`` measured steps of each variant, in this process (inside valgrind:
    one callgrind dump per variant, in order; else under cProfile)."""
    for variant in variants:
        step = _stepper(variant, width, seq, batch)
        if mode == "callgrind":
            torch._C._valgrind_toggle()
            for _ in range(steps):
                step()
            torch._C._valgrind_toggle_and_dump_stats()  # counters restart at zero
            continue
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            step()
        profile.disable()
        calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
        print(f"CALLS {variant} {calls / steps:.0f}", flush=True)


#: The repository root: the children import this copy of remat.
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(argv: list[str]) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout


def instructions(variants: list[str], args: argparse.Namespace) -> list[float]:
    """Instructions per step of each variant, from callgrind's dumps (one valgrind run)."""
    out_dir = tempfile.mkdtemp(prefix="remat-callgrind-")
    try:
        _run([
            "valgrind", "--tool=callgrind", "--collect-atstart=no",
            f"--callgrind-out-file={out_dir}/cg",
            sys.executable, __file__, "--mode", "callgrind", "--child", *variants,
            *_shape(args),
        ])
        dumps = sorted(glob.glob(f"{out_dir}/cg.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        totals = []
        for path in dumps:
            with open(path) as f:
                text = f.read()
            match = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
            totals.append(int(match.group(1)) / args.steps if match else float("nan"))
        return totals[: len(variants)]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def python_calls(variants: list[str], args: argparse.Namespace) -> list[float]:
    out = _run([sys.executable, __file__, "--mode", "cprofile", "--child", *variants,
                *_shape(args)])
    calls = dict(re.findall(r"CALLS (\S+) (\d+)", out))
    return [float(calls[v]) for v in variants]


def _shape(args: argparse.Namespace) -> list[str]:
    return [f"--steps={args.steps}", f"--width={args.width}", f"--seq={args.seq}",
            f"--batch={args.batch}"]


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    """Measure, print the table; returns {variant: (instructions, Python calls) per step}."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--no-callgrind", action="store_true")
    parser.add_argument("--child", nargs="*", default=None)
    parser.add_argument("--mode", default="cprofile")
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child, args.steps, args.width, args.seq, args.batch, args.mode)
        return {}
    variants = args.variants or [v for pair in PAIRS for v in pair] + [demo.TORCH_CHECKPOINT]
    variants = list(dict.fromkeys(variants))
    use_callgrind = not args.no_callgrind and shutil.which("valgrind") is not None
    counts = instructions(variants, args) if use_callgrind else [float("nan")] * len(variants)
    rows = dict(zip(variants, zip(counts, python_calls(variants, args), strict=True),
                    strict=True))
    print("| variant | instructions/step | Python calls/step | vs torch equivalent |")
    print("|---|---:|---:|---:|")
    reference = dict(PAIRS)
    for variant, (ins, calls) in rows.items():
        ref = rows.get(reference.get(variant, ""))
        ratio = f"{ins / ref[0]:.3f}x ({reference[variant]})" if ref and ref[0] else ""
        print(f"| `{variant}` | {ins / 1e6:.2f}M | {calls:.0f} | {ratio} |")
    if "save-last" in rows and demo.TORCH_CHECKPOINT in rows:
        print(f"\nsave-last / torch-checkpoint: "
              f"{rows['save-last'][0] / rows[demo.TORCH_CHECKPOINT][0]:.3f}x instructions")
    return rows


if __name__ == "__main__":
    main()
