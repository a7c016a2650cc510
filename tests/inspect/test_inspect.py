"""`saved_residuals` reports what backward holds: shapes, decisions, bytes and source lines."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import (
    PolicyCost,
    Residual,
    policy_costs,
    print_saved_residuals,
    residual_totals,
    saved_residuals,
)
from remat._inspect.compare import format_costs
from remat.policies import Decision

HERE = pathlib.Path(__file__)


def line_of(marker: str) -> int:
    """The line number of the line of this file that ends with ``# marker``."""
    lines = HERE.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


class Block(nn.Module):
    """A pre-norm transformer block with two-dimensional matmuls and one batched attention."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=-1)  # qkv
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = torch.softmax(q @ k.transpose(-1, -2) / (w // self.heads) ** 0.5, dim=-1)
        attn = (scores @ v).transpose(1, 2).reshape(b, s, w)
        x = x + self.proj(attn)
        hidden = remat.checkpoint_name(F.gelu(self.fc1(self.ln2(x))), "hidden")  # fc1
        return x + self.fc2(hidden)


@pytest.fixture
def block() -> Block:
    return Block()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(2, 5, 16, requires_grad=True)


def kept_bytes(residuals: list[Residual]) -> int:
    totals = residual_totals(residuals)
    return totals["saved"] + totals["offloaded"]


def test_bytes_grow_with_what_the_policy_saves(block: Block, x: torch.Tensor) -> None:
    nothing = saved_residuals(block, x, policy="nothing-saveable")
    dots = saved_residuals(block, x, policy="dots-saveable")
    everything = saved_residuals(block, x, policy="everything-saveable")
    assert kept_bytes(nothing) == 0
    assert 0 < kept_bytes(dots) < kept_bytes(everything)
    assert residual_totals(nothing)["input"] == residual_totals(dots)["input"]


def test_nothing_saveable_holds_only_inputs_and_parameters(block: Block, x: torch.Tensor) -> None:
    held = saved_residuals(block, x, policy=remat.policies.nothing_saveable)
    assert {r.decision for r in held} == {"input"}
    assert "argument x" in {r.source for r in held}
    assert {r.source for r in held} >= {"parameter ln1.weight", "parameter ln2.bias"}


def test_dots_entries_have_shape_op_and_source_line(block: Block, x: torch.Tensor) -> None:
    held = saved_residuals(block, x, policy="dots-saveable")
    kept = [r for r in held if r.decision is Decision.SAVE]
    by_source = {r.source: r for r in kept}
    qkv = by_source[f"test_inspect.py:{line_of('qkv')} (forward)"]
    assert qkv.shape == (10, 48) and qkv.op is torch.ops.aten.addmm.default
    assert qkv.nbytes == 10 * 48 * 4 and qkv.dtype == torch.float32
    fc1 = by_source[f"test_inspect.py:{line_of('fc1')} (forward)"]
    assert fc1.shape == (10, 64) and fc1.op is torch.ops.aten.addmm.default
    assert {r.op.overloadpacket for r in kept} <= {torch.ops.aten.addmm, torch.ops.aten.bmm}


def test_no_batch_dims_policy_drops_the_batched_matmuls(block: Block, x: torch.Tensor) -> None:
    dots = saved_residuals(block, x, policy="dots-saveable")
    no_batch = saved_residuals(block, x, policy="dots-no-batch-saveable")
    assert {r.op.overloadpacket for r in no_batch if r.op is not None} == {torch.ops.aten.addmm}
    assert kept_bytes(no_batch) < kept_bytes(dots)


def test_names_are_reported(block: Block, x: torch.Tensor) -> None:
    held = saved_residuals(block, x, policy="save:hidden")
    named = [r for r in held if r.decision is Decision.SAVE]
    assert [(r.name, r.shape, r.op) for r in named] == [
        ("hidden", (2, 5, 64), torch.ops.aten.gelu.default)
    ]
    assert named[0].source == f"test_inspect.py:{line_of('fc1')} (forward)"


def test_offload_decisions_are_reported(block: Block, x: torch.Tensor) -> None:
    held = saved_residuals(block, x, policy="offload-dots")
    assert Decision.OFFLOAD in {r.decision for r in held}
    assert residual_totals(held)["saved"] == 0 < residual_totals(held)["offloaded"]


def test_pytree_arguments_are_named_by_path() -> None:
    def f(xs: tuple[torch.Tensor, torch.Tensor], params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.sin(xs[0] * params["w"]).sum() + xs[1].sum()

    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    sources = {r.source for r in saved_residuals(f, (a, b), {"w": w})}
    assert {"argument xs[0]", "argument params['w']"} <= sources


def test_views_of_parameters_count_as_inputs(block: Block, x: torch.Tensor) -> None:
    held = saved_residuals(block, x, policy="everything-saveable")
    transposed = [r for r in held if r.op is torch.ops.aten.t.default]
    assert transposed and all(r.decision == "input" for r in transposed)
    assert any("a view of parameter fc1.weight" in r.source for r in transposed)


def test_shared_storages_are_counted_once() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x)
        a, b = y.split(2)
        return (a.exp() * b.exp()).sum()

    held = saved_residuals(f, torch.randn(4, requires_grad=True), policy="everything-saveable")
    saved = [r for r in held if r.decision is Decision.SAVE and r.op is torch.ops.aten.split.Tensor]
    assert sum(not r.shared for r in saved) <= 1
    total = residual_totals(held)["saved"]
    assert total == sum(r.nbytes for r in held if r.decision is Decision.SAVE and not r.shared)


def test_inspection_leaves_no_state_behind(block: Block, x: torch.Tensor) -> None:
    saved_residuals(block, x, policy="save-last")
    out = remat.remat(block, policy="dots-saveable")(x)
    out.sum().backward()
    assert x.grad is not None


def test_print_saved_residuals(capsys: pytest.CaptureFixture[str], x: torch.Tensor) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(torch.sin(x)).sum()  # two sins

    print_saved_residuals(f, x, policy="everything-saveable")
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["shape", "dtype", "bytes", "decision", "produced", "by", "source"]
    assert out[1].split() == ["(2,", "5,", "16)", "float32", "640", "input", "-", "argument", "x"]
    line = f"test_inspect.py:{line_of('two sins')} (f)"
    assert out[2].split()[4:] == ["640", "saved", "sin", *line.split()]
    assert out[-1] == (
        "total: 640 B in region inputs (1 tensor); 640 B kept by the policy "
        "(saved 640 B in 1 tensor, offloaded 0 B in 0 tensors)"
    )


def test_policy_costs_rows(block: Block, x: torch.Tensor) -> None:
    rows = policy_costs(block, x, policies=["nothing-saveable", "everything-saveable"], repeats=1)
    assert [r.policy for r in rows] == ["none", "nothing-saveable", "everything-saveable"]
    none, nothing, everything = rows
    assert nothing.held_bytes < everything.held_bytes
    assert nothing.recomputed_ops > 0 and none.recomputed_ops == 0
    assert everything.recomputed_ops == 0
    assert "policy" in format_costs(rows)
    assert isinstance(rows[0], PolicyCost)


def test_compare_prints_a_row_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    w = torch.randn(16, 16, requires_grad=True)
    rows = remat.compare(
        lambda x: torch.tanh(torch.tanh(x @ w) @ w), torch.randn(8, 16),
        policies=["nothing-saveable", "everything-saveable"], repeats=1,
    )
    printed = capsys.readouterr().out
    assert [r.policy for r in rows] == ["none", "nothing-saveable", "everything-saveable"]
    assert all(r.policy in printed for r in rows)
    none, nothing, everything = rows
    assert nothing.held_bytes < everything.held_bytes == none.held_bytes
    assert nothing.recomputed_ops > 0 == everything.recomputed_ops
