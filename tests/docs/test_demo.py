"""`python -m remat` runs, prints every variant, and every variant's gradients match."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from remat import __main__ as demo_main
from remat import _demo_model as demo

TINY = ["--depth", "2", "--width", "16", "--heads", "2", "--batch", "2", "--seq", "8",
        "--repeats", "1"]


@pytest.fixture(scope="module")
def demo_run() -> tuple[list[demo_main.Row], str]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        rows = demo_main.main(TINY)
    return rows, buffer.getvalue()


def test_demo_prints_every_variant_and_grads_match(
    demo_run: tuple[list[demo_main.Row], str],
) -> None:
    rows, table = demo_run
    assert [r.label for r in rows] == [label for label, _ in demo_main.VARIANTS]
    for row in rows:
        assert f"| {row.label} " in table
        assert row.grads_match, f"{row.label}: max grad difference {row.grad_diff}"
    assert "NO (" not in table


def test_demo_recompute_counts(demo_run: tuple[list[demo_main.Row], str]) -> None:
    rows = {r.label: r for r in demo_run[0]}
    assert rows["no remat"].recomputed_ops == 0
    assert rows["everything-saveable"].recomputed_ops == 0
    # each block's forward is recomputed once: as many ops as torch's checkpoint
    assert rows["nothing-saveable"].recomputed_ops == rows["torch checkpoint"].recomputed_ops > 0
    # save-last skips the last of the two blocks
    assert 2 * rows["save-last"].recomputed_ops == rows["nothing-saveable"].recomputed_ops


def test_stack_variants_agree() -> None:
    model = demo.Stack(depth=2, width=16, heads=2)
    x = demo.make_input(model, batch=2, seq=4)
    expected = model(x)
    for _, how in demo_main.VARIANTS:
        torch.testing.assert_close(model(x, how), expected)


def test_unknown_selective_policy_is_rejected() -> None:
    model = demo.Stack(depth=1, width=8, heads=2)
    with pytest.raises(ValueError, match="torch selective checkpointing supports"):
        model(demo.make_input(model, batch=1, seq=2), demo.TORCH_SELECTIVE + "save-last")


def test_block_rejects_width_not_divisible_by_heads() -> None:
    with pytest.raises(ValueError, match="not a multiple of heads"):
        demo.Block(10, 4)


def test_demo_prints_no_warning_in_a_fresh_process() -> None:
    # A fresh venv without numpy made torch warn "Failed to initialize NumPy" here.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "remat", *TINY], capture_output=True, text=True, timeout=300,
        check=True,
    )
    assert done.stderr == ""
    assert "grads match" in done.stdout
