"""Tests for remat._policy.ops: which aten ops count as dots, random ops, views, in-place ops."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from remat._policy import ops as _ops

aten = torch.ops.aten

# (op, is_dot, is_dot_without_batch_dims)
DOT_TABLE = [
    (aten.mm.default, True, True),
    (aten.mm.out, True, True),
    (aten.addmm.default, True, True),
    (aten._addmm_activation.default, True, True),
    (aten.mv.default, True, True),
    (aten.addmv.default, True, True),
    (aten.dot.default, True, True),
    (aten.vdot.default, True, True),
    (aten.bmm.default, True, False),
    (aten.baddbmm.default, True, False),
    (aten.addbmm.default, True, False),
    (aten.convolution.default, True, False),
    (aten._convolution.default, True, False),
    (aten.mkldnn_convolution.default, True, False),
    (aten._slow_conv2d_forward.default, True, False),
    (aten._scaled_dot_product_flash_attention_for_cpu.default, True, False),
    (aten._scaled_dot_product_efficient_attention.default, True, False),
    (aten.relu.default, False, False),
    (aten.add.Tensor, False, False),
    (aten.matmul.default, False, False),  # composite: decomposes into mm/bmm
    (aten.linear.default, False, False),  # composite: decomposes into addmm/mm
    (aten.view.default, False, False),
    (None, False, False),
]


@pytest.mark.parametrize(("op", "dot", "no_batch"), DOT_TABLE, ids=str)
def test_dot_table(op: Any, dot: bool, no_batch: bool) -> None:
    assert _ops.is_dot(op) is dot
    assert _ops.is_dot_without_batch_dims(op) is no_batch


def test_no_batch_dots_are_dots() -> None:
    assert _ops.DOT_NO_BATCH_OPS <= _ops.DOT_OPS
    assert all(isinstance(p, torch._ops.OpOverloadPacket) for p in _ops.DOT_OPS)


# (op, is_random, is_view, is_inplace_or_out)
OTHER_TABLE = [
    (aten.rand.default, True, False, False),
    (aten.randn.default, True, False, False),
    (aten.bernoulli.default, True, False, False),
    (aten.native_dropout.default, True, False, False),
    (aten.normal_.default, True, False, True),
    (aten.view.default, False, True, False),
    (aten.transpose.int, False, True, False),
    (aten.t.default, False, True, False),
    (aten.expand.default, False, True, False),
    (aten.clone.default, False, False, False),
    (aten.add.Tensor, False, False, False),
    (aten.add_.Tensor, False, False, True),
    (aten.add.out, False, False, True),
    (aten.mm.out, False, False, True),
    (aten.copy_.default, False, False, True),
    (None, False, False, False),
]


@pytest.mark.parametrize(("op", "random", "view", "mutates"), OTHER_TABLE, ids=str)
def test_other_classes(op: Any, random: bool, view: bool, mutates: bool) -> None:
    assert _ops.is_random(op) is random
    assert _ops.is_view(op) is view
    assert _ops.is_inplace_or_out(op) is mutates


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _observed(fn: Any, *args: torch.Tensor) -> list[Any]:
    with _Recorder() as rec:
        fn(*args)
    return rec.ops


def test_linear_on_3d_input_is_a_no_batch_dot() -> None:
    ops = _observed(F.linear, torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5))
    dots = [op for op in ops if _ops.is_dot(op)]
    assert dots, ops
    assert all(_ops.is_dot_without_batch_dims(op) for op in dots)


def test_batched_matmul_is_a_batch_dot() -> None:
    ops = _observed(torch.matmul, torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    dots = [op for op in ops if _ops.is_dot(op)]
    assert dots, ops
    assert not any(_ops.is_dot_without_batch_dims(op) for op in dots)


def test_conv2d_is_a_batch_dot() -> None:
    ops = _observed(F.conv2d, torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3))
    dots = [op for op in ops if _ops.is_dot(op)]
    assert dots, ops
    assert not any(_ops.is_dot_without_batch_dims(op) for op in dots)


def test_sdpa_is_a_batch_dot() -> None:
    q = torch.randn(1, 2, 4, 8)
    ops = _observed(F.scaled_dot_product_attention, q, q, q)
    dots = [op for op in ops if _ops.is_dot(op)]
    assert dots, ops
    assert not any(_ops.is_dot_without_batch_dims(op) for op in dots)


def test_dropout_is_random() -> None:
    ops = _observed(lambda x: F.dropout(x, 0.5, training=True), torch.randn(4, 4))
    assert any(_ops.is_random(op) for op in ops), ops
