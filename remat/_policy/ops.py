"""Classify aten ops for policies: dots, random ops, views, in-place ops.

Every function takes a ``torch._ops.OpOverload`` (or ``None``, which is never in
any class) and compares its ``OpOverloadPacket``, so every overload of an op
counts. Lookups are frozenset memberships: they run for every op of a region.

NOTE [ What counts as a dot ]
1. JAX's ``dots_saveable`` saves the outputs of ``dot_general`` (and convolution).
   The aten ops that play that role are the matmul family (``mm``, ``addmm``,
   ``bmm``, ...; ``mv``/``dot`` too, since ``dot_general`` covers them), the
   convolutions (the generic entry points and the backend kernels they dispatch
   to) and the scaled-dot-product-attention kernels.
2. "No batch dims" means a plain 2-D (or 1-D) contraction: ``mm``, ``addmm``,
   ``_addmm_activation``, ``mv``, ``addmv``, ``dot``, ``vdot``. A ``Linear`` on an
   input of any rank lands here, because it flattens the leading dims first.
3. Names missing from the installed torch are skipped, so older versions work.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "DOT_OPS",
    "DOT_NO_BATCH_OPS",
    "is_dot",
    "is_dot_without_batch_dims",
    "is_inplace_or_out",
    "is_random",
    "is_view",
]

_NO_BATCH_DOT_NAMES = ("mm", "addmm", "_addmm_activation", "mv", "addmv", "dot", "vdot")

_DOT_NAMES = (
    *_NO_BATCH_DOT_NAMES,
    "bmm",
    "baddbmm",
    "addbmm",
    # convolutions: the generic entry points and the backend kernels
    "convolution",
    "_convolution",
    "mkldnn_convolution",
    "cudnn_convolution",
    "miopen_convolution",
    "convolution_overrideable",
    "_slow_conv2d_forward",
    "slow_conv3d_forward",
    "_conv_depthwise2d",
    "conv_depthwise3d",
    "slow_conv_dilated2d",
    "slow_conv_dilated3d",
    "slow_conv_transpose2d",
    "slow_conv_transpose3d",
    # scaled-dot-product attention kernels
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_scaled_dot_product_fused_attention_overrideable",
)


def _packets(names: tuple[str, ...]) -> frozenset[Any]:
    aten = torch.ops.aten
    found = []
    for name in names:
        try:
            found.append(getattr(aten, name))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


#: The ``OpOverloadPacket``s whose outputs ``dots_saveable`` keeps.
DOT_OPS: frozenset[Any] = _packets(_DOT_NAMES)
#: The ``OpOverloadPacket``s whose outputs ``dots_with_no_batch_dims_saveable`` keeps.
DOT_NO_BATCH_OPS: frozenset[Any] = _packets(_NO_BATCH_DOT_NAMES)


def _packet(op: Any) -> Any:
    return getattr(op, "overloadpacket", None)


#: id(op) -> (op, `is_dot`, `is_dot_without_batch_dims`). A packet hashes in Python
#: and the dots policies ask about every op they record: once per op object (held
#: here, so its id is not reused). Bounded, as ops made per call could be.
_DOTS: dict[int, tuple[Any, bool, bool]] = {}


def _dots(op: Any) -> tuple[Any, bool, bool]:
    found = _DOTS.get(id(op))
    if found is None or found[0] is not op:
        if len(_DOTS) >= 4096:
            _DOTS.clear()
        packet = _packet(op)
        found = _DOTS[id(op)] = (op, packet in DOT_OPS, packet in DOT_NO_BATCH_OPS)
    return found


def is_dot(op: Any) -> bool:
    """Return whether ``op`` is a matmul, convolution or attention kernel.

    Args:
        op (torch._ops.OpOverload | None): the op; ``None`` gives ``False``.

    Returns:
        bool: whether ``dots_saveable`` keeps the op's outputs.

    >>> is_dot(torch.ops.aten.bmm.default), is_dot(torch.ops.aten.relu.default)
    (True, False)
    """
    return _dots(op)[1]


def is_dot_without_batch_dims(op: Any) -> bool:
    """Return whether ``op`` is a dot with no batch dimension (``mm``, ``addmm``, ...).

    Args:
        op (torch._ops.OpOverload | None): the op; ``None`` gives ``False``.

    Returns:
        bool: whether ``dots_with_no_batch_dims_saveable`` keeps the op's outputs.

    >>> is_dot_without_batch_dims(torch.ops.aten.addmm.default)
    True
    >>> is_dot_without_batch_dims(torch.ops.aten.bmm.default)
    False
    """
    return _dots(op)[2]


def is_random(op: Any) -> bool:
    """Return whether ``op`` draws from the random generator.

    Args:
        op (torch._ops.OpOverload | None): the op; ``None`` gives ``False``.

    Returns:
        bool: whether the op is tagged ``torch.Tag.nondeterministic_seeded``.

    >>> is_random(torch.ops.aten.rand.default), is_random(torch.ops.aten.add.Tensor)
    (True, False)
    """
    tags: Any = getattr(op, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def is_view(op: Any) -> bool:
    """Return whether ``op`` returns a view of one of its inputs.

    Args:
        op (torch._ops.OpOverload | None): the op; ``None`` gives ``False``.

    Returns:
        bool: whether the op's schema marks its output as an alias.

    >>> is_view(torch.ops.aten.view.default), is_view(torch.ops.aten.clone.default)
    (True, False)
    """
    return bool(getattr(op, "is_view", False))


def is_inplace_or_out(op: Any) -> bool:
    """Return whether ``op`` writes into one of its arguments (``add_``, ``add.out``).

    Args:
        op (torch._ops.OpOverload | None): the op; ``None`` gives ``False``.

    Returns:
        bool: whether the op's schema mutates an argument.

    >>> is_inplace_or_out(torch.ops.aten.add_.Tensor)
    True
    >>> is_inplace_or_out(torch.ops.aten.add.out), is_inplace_or_out(torch.ops.aten.add.Tensor)
    (True, False)
    """
    schema = getattr(op, "_schema", None)
    return schema is not None and bool(schema.is_mutable)
