"""The benchmark scripts run (at small size), and the docs show what they print."""

from __future__ import annotations

import contextlib
import io
import pathlib
from types import ModuleType

from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name: str) -> ModuleType:
    return load_script("benchmarks", name)


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


def test_compiled_bench_matches_torch_checkpointing_byte_for_byte() -> None:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        results = load("compiled").main(small=True)
    rows = {row["variant"]: row for row in results["rows"]}
    assert all(row["max_grad_diff"] < 1e-5 and row["graphs"] == 1 for row in rows.values())
    same = [
        ("remat nothing-saveable", "torch checkpoint"),
        ("remat dots-saveable", "torch selective (dots ops)"),
    ]
    for ours, theirs in same:
        for column in ("saved_bytes", "saved_random_states", "backward_matmuls"):
            assert rows[ours][column] == rows[theirs][column], (ours, column)
    saved = [rows[f"remat {p}"]["saved_bytes"] for p in ("nothing-saveable", "dots-saveable")]
    assert saved[0] < saved[1] < rows["no remat"]["saved_bytes"]
    # The dots policies recompute no matmul; nothing-saveable recomputes them.
    assert rows["remat dots-saveable"]["backward_matmuls"] == rows["no remat"]["backward_matmuls"]
    assert rows["remat nothing-saveable"]["backward_matmuls"] > rows["no remat"]["backward_matmuls"]
    assert "| remat dots-saveable |" in out.getvalue()


def test_policy_table_in_the_docs_is_what_the_script_prints() -> None:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        load("policy_table").main()
    assert out.getvalue().strip() in (ROOT / "docs" / "policies.md").read_text()


def test_checks_cost_runs_and_remat_holds_less_in_eager() -> None:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = load("checks_cost").main(
            ["--width", "16", "--depth", "2", "--batch", "2", "--seq", "8", "--heads", "2",
             "--repeats", "1"]
        )
    assert all(0 < cost < 100 for cost in result["costs"].values())
    peaks = result["peaks"]
    assert peaks[("eager", "nothing-saveable")] < peaks[("eager", None)]
    assert "check on / off" in out.getvalue()


def test_compile_names_bench_saves_what_the_eager_engine_holds() -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        results = load("compile_names").main(small=True)
    rows = {row["policy"]: row for row in results["rows"]}
    assert all(row["graphs"] == 1 for row in rows.values())  # names lower: no graph break
    assert all(max(row["compiled_grad_diff"], row["eager_grad_diff"]) < 1e-5
               for row in rows.values())
    # Outside the regions the partitioner makes its own choices: the offset of
    # nothing-saveable. The save:/save-except: rows differ from the eager engine
    # by that offset only; dots-saveable + a name, exactly as the eager engine.
    offset = rows["nothing-saveable"]["compiled_saved_bytes"] - rows["nothing-saveable"][
        "eager_held_bytes"]
    for policy in ("save:attn_out", "save:mlp_hidden", "save:attn_out,mlp_hidden",
                   "save-except:attn_out"):
        row = rows[policy]
        assert row["compiled_saved_bytes"] - row["eager_held_bytes"] == offset, policy
    both = rows["dots-saveable+save:mlp_hidden"]
    assert both["compiled_saved_bytes"] == both["eager_held_bytes"]
    # A view of a value the policy drops is dropped too (NOTE [ Record and replay ] rule 8).
    dropped = rows["everything-except:mlp_hidden"]
    assert dropped["compiled_saved_bytes"] == dropped["eager_held_bytes"]
    assert dropped["compiled_backward_matmuls"] == dropped["eager_backward_matmuls"]
    assert both["compiled_saved_bytes"] > rows["dots-saveable"]["compiled_saved_bytes"]
