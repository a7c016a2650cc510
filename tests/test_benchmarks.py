"""The benchmark scripts run (at small size), and the docs show what they print."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(name: str) -> ModuleType:
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_runs_and_every_variant_matches_no_remat() -> None:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        results = load("bench").main(small=True)
    rows = {row["variant"]: row for row in results["rows"]}
    assert all(row["max_grad_diff"] < 1e-5 for row in rows.values()), rows
    fake = rows["remat offload-dots (fake host store, CPU simulation)"]
    dots = rows["remat dots-saveable"]
    assert fake["host_bytes"] > 0 and fake["held_bytes"] < dots["held_bytes"]
    assert rows["remat offload-dots"]["host_bytes"] == 0  # CPU: the CUDA store saves instead
    assert "offload-dots vs dots-saveable: step time" in out.getvalue()
    assert results["torch_func_grad"]["remat nothing-saveable"].startswith("runs")


def test_policy_table_in_the_docs_is_what_the_script_prints() -> None:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        load("policy_table").main()
    assert out.getvalue().strip() in (ROOT / "docs" / "policies.md").read_text()
