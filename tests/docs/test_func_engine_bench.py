"""``benchmarks/func_engine.py`` runs tiny and prints its table."""

from __future__ import annotations

import contextlib
import io

from helpers import load_script


def test_func_engine_bench_runs_tiny_at_the_eager_floor() -> None:
    argv = ["--widths", "16", "--depth", "2", "--batch", "2", "--seq", "8", "--repeats", "1"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rows = load_script("benchmarks", "func_engine").main(argv)
    assert [r["policy"] for r in rows] == ["nothing-saveable", "save-last", "dots-saveable"]
    assert all(r["max_grad_diff"] < 1e-5 and r["func_time"] > 0 for r in rows)
    # The exact peaks are tests/engines/test_functional_memory.py's; here the goal.
    for r in rows[:2]:
        assert r["func_peak"] <= 1.05 * r["eager_peak"], r
    assert "| 16 | save-last |" in out.getvalue()
