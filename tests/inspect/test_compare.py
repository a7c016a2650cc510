"""`remat.compare`: per-block comparison on a module, time spread, plot, progress, arguments."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat import PolicyCost, measure_memory, residual_totals, saved_residuals


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


POLICIES = ("nothing-saveable", "dots-saveable", "everything-saveable")


@pytest.fixture
def model() -> nn.Sequential:
    return nn.Sequential(*[Block() for _ in range(4)])


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(64, 16)  # activations outweigh the parameters' gradients


def test_where_compares_per_block_application(model: nn.Sequential, x: torch.Tensor) -> None:
    rows = remat.policy_costs(model, x, policies=POLICIES, where=Block, repeats=1)
    by = {r.policy: r for r in rows}
    none, nothing, dots, everything = (by[p] for p in ("none", *POLICIES))
    # Per block, policies differ on the full model: nothing-saveable holds only the block
    # boundaries and peaks lower; everything-saveable is plain autograd.
    assert nothing.peak_bytes < none.peak_bytes and nothing.held_bytes < dots.held_bytes
    assert (everything.peak_bytes, everything.held_bytes) == (none.peak_bytes, none.held_bytes)
    assert nothing.recomputed_ops > dots.recomputed_ops > everything.recomputed_ops == 0
    # Each row's held bytes are exactly what the applied model keeps, plus the 4-byte loss.
    for policy in POLICIES:
        remat.apply(model, policy=policy, where=Block)
        totals = residual_totals(saved_residuals(model, x))
        assert by[policy].held_bytes == totals["saved"] + 4
        remat.unwrap(model)
    assert not any(remat.is_wrapped(m) for m in model.modules())  # compare put it back


def test_one_region_around_the_model_is_what_where_fixes(
    model: nn.Sequential, x: torch.Tensor
) -> None:
    whole = remat.policy_costs(model, x, policies="nothing-saveable", repeats=1)
    blocks = remat.policy_costs(model, x, policies="nothing-saveable", where=Block, repeats=1)
    assert whole[1].peak_bytes == whole[0].peak_bytes  # recomputes the whole model at once
    assert blocks[1].peak_bytes < whole[1].peak_bytes


def test_peaks_count_gradients_alike_in_every_row(model: nn.Sequential, x: torch.Tensor) -> None:
    rows = remat.policy_costs(model, x, policies=["everything-saveable"], repeats=1)
    step = measure_memory(lambda x: model(x).sum(), x)  # no .grad yet: counts them too
    assert rows[0].peak_bytes == rows[1].peak_bytes == step.peak_bytes


def test_a_bare_string_is_one_policy(model: nn.Sequential, x: torch.Tensor) -> None:
    rows = remat.policy_costs(model, x, policies="dots-saveable", repeats=1)
    assert [r.policy for r in rows] == ["none", "dots-saveable"]


def test_time_is_a_median_with_its_spread(
    model: nn.Sequential, x: torch.Tensor, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = remat.compare(model, x, policies="nothing-saveable", where=Block, repeats=3)
    assert rows[0].time_ratio == 1.0 and rows[0].time_spread == 0.0
    assert rows[1].time_ratio > 0 and rows[1].time_spread >= 0
    line = capsys.readouterr().out.splitlines()[2]
    assert line.split()[-2:] == [f"{rows[1].time_ratio:.2f}x", f"±{rows[1].time_spread:.2f}"]


def test_progress_goes_to_stderr_when_asked(
    model: nn.Sequential, x: torch.Tensor, capsys: pytest.CaptureFixture[str]
) -> None:
    remat.policy_costs(model, x, policies=POLICIES[:1], repeats=1)  # not a terminal: quiet
    assert capsys.readouterr().err == ""
    remat.policy_costs(model, x, policies=POLICIES[:1], repeats=2, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("remat.policy_costs: [1/2] none: peak ")
    assert lines[1].startswith("remat.policy_costs: [2/2] nothing-saveable: peak ")
    assert lines[2].startswith("remat.policy_costs: timed 2 rounds (")


def test_plot_returns_a_figure(model: nn.Sequential, x: torch.Tensor) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    rows, figure = remat.compare(model, x, policies=POLICIES, where=Block, repeats=1, plot=True)
    assert isinstance(figure, Figure) and all(isinstance(r, PolicyCost) for r in rows)
    memory, timing = figure.axes
    assert timing.get_title() == "time vs none"
    assert [t.get_text() for t in memory.get_xticklabels()] == ["none", *POLICIES]
    peaks = [bar.get_height() for bar in memory.patches[: len(rows)]]
    assert peaks == [r.peak_bytes for r in rows]


def test_where_needs_a_module_that_is_not_wrapped(model: nn.Sequential, x: torch.Tensor) -> None:
    with pytest.raises(TypeError, match="where= applies each policy per block of a module"):
        remat.policy_costs(lambda x: model(x), x, where=Block, repeats=1)
    remat.apply(model, where=Block)
    already = r"Sequential has wrapped submodules already \(0, 1, 2, \.\.\.\); call remat.unwrap"
    with pytest.raises(ValueError, match=already):
        remat.policy_costs(model, x, where=Block, repeats=1)
    rows = remat.policy_costs(remat.unwrap(model), x, where=Block, repeats=1)  # the fix
    assert len(rows) == 4


def test_a_bad_policy_raises_before_anything_runs(model: nn.Sequential, x: torch.Tensor) -> None:
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    with pytest.raises(ValueError, match="dots-savable"):
        remat.policy_costs(model, x, policies=["dots-savable"])
    assert calls == []
