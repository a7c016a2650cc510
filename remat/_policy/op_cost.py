"""A deterministic estimate of what running one aten op again costs: FLOPs plus bytes moved.

NOTE [ Recompute cost ]
1. The memory-budget planner (``_planner.py``) weighs what each dropped op
   costs to run again. Timing ops would make the plan depend on the machine
   and on noise; this estimate depends only on the op and its shapes, so the
   same shapes always give the same plan.
2. FLOPs: a matmul ``[m, k] @ [k, n]`` is ``2mkn`` (``bmm`` times its batch,
   ``addmm``/``baddbmm`` plus the add), a convolution ``2 * out * (C_in /
   groups * kernel)``, attention ``4 * b * h * L * S * d``; every other op one
   FLOP per output element.
3. Bytes moved: every tensor argument read and every output written, once. So
   memory-bound ops (norms, activations, adds) are not free: on a real
   accelerator they cost about as much time per byte as a matmul costs per
   FLOP only at very large sizes, and counting bytes one-for-one with FLOPs
   keeps a chain of them from looking cheaper than one matmul it replaces.
4. Views cost nothing: they move no data (the engines run them anyway).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from . import ops as _ops

__all__ = ["op_cost"]

#: (shape, dtype) of a tensor argument, as ``OpRecord.input_shapes`` holds them.
Shape = tuple[Any, torch.dtype]

_MM = {"mm", "mv", "dot", "vdot"}
_ADDMM = {"addmm", "_addmm_activation", "addmv"}
_BMM = {"bmm"}
_BADDBMM = {"baddbmm", "addbmm"}
_ATTENTION_PREFIXES = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")


def _numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


def _nbytes(shape: Any, dtype: torch.dtype) -> int:
    return _numel(shape) * dtype.itemsize


def _name(op: Any) -> str:
    packet = getattr(op, "overloadpacket", None)
    return str(getattr(packet, "__name__", "")) if packet is not None else ""


def _dot_flops(name: str, inputs: Sequence[Shape], out_numel: int) -> int | None:
    """FLOPs of a dot-like op, or None when its arguments are not what the rule expects."""
    shapes = [tuple(shape) for shape, _ in inputs]
    if name in _MM and len(shapes) >= 2 and shapes[0]:
        return 2 * out_numel * int(shapes[0][-1])
    if name in _ADDMM and len(shapes) >= 3 and shapes[1]:
        return 2 * out_numel * int(shapes[1][-1]) + out_numel
    if name in _BMM and len(shapes) >= 2 and len(shapes[0]) == 3:
        return 2 * out_numel * int(shapes[0][2])
    if name in _BADDBMM and len(shapes) >= 3 and len(shapes[1]) == 3:
        return 2 * out_numel * int(shapes[1][2]) + out_numel
    if "conv" in name and len(shapes) >= 2 and len(shapes[1]) >= 2:
        return 2 * out_numel * _numel(shapes[1][1:])
    if name.startswith(_ATTENTION_PREFIXES) and len(shapes) >= 2 and len(shapes[0]) == 4:
        b, h, length, d = (int(s) for s in shapes[0])
        return 4 * b * h * length * int(shapes[1][2]) * d
    return None


def op_cost(op: Any, inputs: Sequence[Shape] | None, outputs: Sequence[Shape]) -> int:
    """The recompute cost of one op: FLOPs plus bytes read and written (NOTE above).

    Args:
        op (torch._ops.OpOverload): the aten op.
        inputs (sequence of (shape, dtype), or None): its tensor arguments; None
            when unknown (then only the outputs count).
        outputs (sequence of (shape, dtype)): its tensor outputs.

    Returns:
        int: the estimate; 0 for views.

    >>> f32 = torch.float32
    >>> # 2 * 4 * 8 * 2 FLOPs + (32 + 16 + 8) floats of 4 bytes
    >>> op_cost(torch.ops.aten.mm.default, [((4, 8), f32), ((8, 2), f32)], [((4, 2), f32)])
    352
    >>> op_cost(torch.ops.aten.relu.default, [((4, 2), f32)], [((4, 2), f32)])  # 8 + 2 * 32
    72
    """
    if _ops.is_view(op):
        return 0
    out_numel = sum(_numel(shape) for shape, _ in outputs)
    moved = sum(_nbytes(shape, dtype) for shape, dtype in outputs)
    flops: int | None = None
    if inputs is not None:
        moved += sum(_nbytes(shape, dtype) for shape, dtype in inputs)
        if _ops.is_dot(op) and outputs:
            flops = _dot_flops(_name(op), inputs, _numel(outputs[0][0]))
    return (out_numel if flops is None else flops) + moved
