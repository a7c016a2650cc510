"""benchmarks/width_sweep.py runs at a tiny size, and pairs every policy with its torch
equivalent at each width and at the demo's size."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib

from helpers import load_script


def test_width_sweep_pairs_each_policy_with_its_torch_equivalent(tmp_path: pathlib.Path) -> None:
    sweep = load_script("benchmarks", "width_sweep")
    out = tmp_path / "sweep.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        result = sweep.main(["--widths", "8", "16", "--seq", "4", "--demo-width", "8",
                             "--demo-seq", "6", "--depth", "2", "--batch", "2", "--heads", "2",
                             "--repeats", "1", "--out", str(out)])
    rows = result["rows"]
    pairs = {(r["policy"], r["torch"]) for r in rows}
    assert pairs == {(p, t) for p, ts in sweep.PAIRS for t in ts}
    assert [(r["width"], r["seq"]) for r in rows[:: len(pairs)]] == [(8, 4), (16, 4), (8, 6)]
    assert all(r["ratio"] > 0 for r in rows)
    # Exact peaks, measured once per variant and size: both save-last rows show one peak.
    save_last = [r for r in rows if r["policy"] == "save-last"]
    assert len({(r["width"], r["seq"], r["peak_bytes"]) for r in save_last}) == 3
    assert all(r["peak_bytes"] > 0 and r["torch_peak_bytes"] > 0 for r in rows)
    assert json.loads(out.read_text())["rows"] == rows
    assert "| remat policy | torch equivalent |" in printed.getvalue()
