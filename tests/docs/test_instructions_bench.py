"""benchmarks/instructions.py runs (call counts only, one tiny step per variant) and
pairs each remat policy with its torch equivalent."""

from __future__ import annotations

import contextlib
import io

from helpers import load_script


def test_instructions_counts_python_calls_per_variant() -> None:
    bench = load_script("benchmarks", "instructions")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        rows = bench.main(["--no-callgrind", "--steps", "1", "--width", "8", "--seq", "4",
                           "--batch", "1", "--variants", "nothing-saveable", "torch-checkpoint"])
    assert set(rows) == {"nothing-saveable", "torch-checkpoint"}
    # Remat's bookkeeping is Python: more calls than torch's checkpoint, never none.
    assert rows["nothing-saveable"][1] > rows["torch-checkpoint"][1] > 0
    assert "| `nothing-saveable` |" in printed.getvalue()
