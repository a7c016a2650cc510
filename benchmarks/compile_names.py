"""Benchmark name policies lowered into ``torch.compile`` against remat's eager engine.

On the GPT-style block stack of ``bench.py`` (``remat._demo_model.Stack``, which
names each block's attention output ``attn_out`` and MLP hidden state
``mlp_hidden``), for each name policy it measures: the bytes the compiled
forward graph saves for the compiled backward graph (exact, from the graph's
metadata, as ``compiled.py`` does; a recomputed random op's generator state is
counted apart), the bytes remat's eager engine holds for backward on the same
step (exact on CPU: the live bytes after the forward, `MemoryMeter`, the loss
excluded), the matmuls each backward runs (gradients plus recomputed ones),
and the largest gradient difference of each from no remat.

Run: ``python benchmarks/compile_names.py`` (``--help`` for sizes). The
backend is ``aot_eager``: AOTAutograd's graphs, run as traced, so the columns
show the partitioner's choices. Prints a Markdown table and returns the
results; nothing here measures time.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat import _demo_model as demo
from remat._inspect.memory import MemoryMeter

POLICIES = (
    "nothing-saveable",  # baselines: op policies, no names
    "dots-saveable",
    "save:attn_out",
    "save:mlp_hidden",
    "save:attn_out,mlp_hidden",
    "save-except:attn_out",
    "everything-except:mlp_hidden",
    "dots-saveable+save:mlp_hidden",
)


def _compiled_script() -> ModuleType:
    """``compiled.py`` beside this file: its graph capture and saved-bytes reader."""
    path = pathlib.Path(__file__).with_name("compiled.py")
    spec = importlib.util.spec_from_file_location("benchmarks_compiled", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


class Matmuls(TorchDispatchMode):
    """Count the matmuls run while active."""

    def __init__(self, targets: set[str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.targets = targets
        self.count = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.count += str(func) in self.targets
        return func(*args, **(kwargs or {}))


def eager_engine(
    model: demo.Stack, x: torch.Tensor, policy: str, targets: set[str]
) -> dict[str, Any]:
    """One eager step under ``policy``: bytes held for backward, backward matmuls, gradients."""
    model.zero_grad(set_to_none=True)
    with MemoryMeter() as meter:
        meter.add_baseline(x)
        loss = model.loss(x, policy)
        held = meter.current - loss.untyped_storage().nbytes()
        with Matmuls(targets) as matmuls:
            loss.backward()
    return {"held": held, "matmuls": matmuls.count, "grads": _grads(model)}


def compiled_step(model: demo.Stack, x: torch.Tensor, policy: str) -> dict[str, Any]:
    """One compiled step under ``policy``: what its graphs save and recompute, gradients
    (``compiled.py``'s `compiled_step`, on a fresh Dynamo cache)."""
    torch._dynamo.reset()
    return _compiled_script().compiled_step(model, x, policy)[1]  # type: ignore[no-any-return]


def _grads(model: demo.Stack) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))


def measure(model: demo.Stack, x: torch.Tensor) -> list[dict[str, Any]]:
    targets = _compiled_script().MATMULS
    reference = eager_engine(model, x, demo.NO_REMAT, targets)["grads"]
    rows = []
    for policy in POLICIES:
        eager = eager_engine(model, x, policy, targets)
        compiled = compiled_step(model, x, policy)
        rows.append({
            "policy": policy,
            "graphs": compiled["graphs"],
            "compiled_saved_bytes": compiled["saved_bytes"],
            "compiled_random_states": compiled["saved_random_states"],
            "eager_held_bytes": eager["held"],
            "compiled_backward_matmuls": compiled["backward_matmuls"],
            "eager_backward_matmuls": eager["matmuls"],
            "compiled_grad_diff": _diff(compiled["grads"], reference),
            "eager_grad_diff": _diff(eager["grads"], reference),
        })
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| policy | compiled saves (bytes) | eager engine holds (bytes) | compiled / eager "
        "| random states saved | backward matmuls compiled / eager | max grad diff compiled "
        "/ eager |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ratio = row["compiled_saved_bytes"] / row["eager_held_bytes"]
        lines.append(
            f"| `{row['policy']}` | {row['compiled_saved_bytes']:,} | "
            f"{row['eager_held_bytes']:,} | {ratio:.3f} | {row['compiled_random_states']} | "
            f"{row['compiled_backward_matmuls']} / {row['eager_backward_matmuls']} | "
            f"{row['compiled_grad_diff']:.1e} / {row['eager_grad_diff']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, small: bool = False) -> dict[str, Any]:
    """Run the benchmark and print the table; return the results."""
    script = _compiled_script()
    _, model, x, config = script.sized_stack(
        __doc__,
        {"depth": 4, "width": 128, "heads": 4, "batch": 8, "seq": 128},
        {"depth": 2, "width": 16, "heads": 2, "batch": 2, "seq": 8},
        argv,
        small,
    )
    rows = measure(model, x)
    script.report(config, markdown(rows))
    return {"config": config, "rows": rows}


if __name__ == "__main__":
    main()
