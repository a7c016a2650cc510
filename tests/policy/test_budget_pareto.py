"""``benchmarks/budget_pareto.py`` runs tiny (``--repeats 1``): every variant's gradients
match no remat, budgets stay monotone, and remat's lowered budgets compile to one graph."""

from __future__ import annotations

import contextlib
import io

import pytest
from helpers import load_script

pytestmark = [
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
]


def test_budget_pareto_runs_tiny() -> None:
    pareto = load_script("benchmarks", "budget_pareto")
    argv = ["--depth", "2", "--width", "16", "--heads", "2", "--batch", "2", "--seq", "8",
            "--repeats", "1"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        results = pareto.main(argv)
    for model in ("demo", "llama"):
        rows = {row["variant"]: row for row in results[model]}
        assert all(row["max_grad_diff"] < 1e-5 for row in rows.values()), model
        costs = [rows[f"budget:{f}"]["recompute_cost"] for f in pareto.FRACTIONS]
        assert costs == sorted(costs, reverse=True), (model, costs)
        held = [rows[f"budget:{f}"]["held_bytes"] for f in pareto.FRACTIONS]
        assert held == sorted(held) and held[-1] == rows["no remat"]["held_bytes"], (model, held)
    compiled = {row["variant"]: row for row in results["compiled"]}
    lowered = [compiled[f"remat budget:{f} (lowered)"] for f in pareto.FRACTIONS]
    assert all(row["graphs"] == 1 for row in lowered)  # in the graph: no graph break
    saved = [row["saved_bytes"] for row in lowered]
    assert saved == sorted(saved) and saved[0] < saved[-1], saved
    text = out.getvalue()
    assert "| budget:0.5 |" in text and "| remat budget:0.5 (lowered) |" in text
