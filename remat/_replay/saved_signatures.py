"""The eager engine's recompute signature: what made each tensor autograd saves.

NOTE [ Recompute signatures ] rule 2 (in ``_replay/checks.py``) is the mechanism:
the forward's pack hook signs every saved tensor (`saved_signature`), and the
recompute's k-th saved tensor is checked against the forward's k-th (`check_saved`).
"""

from __future__ import annotations

from typing import Any

import torch

from .checks import expect_same

__all__ = [
    "STANDS_FOR_LEAF",
    "SavedSignature",
    "check_saved",
    "describe_saved",
    "same_signature",
    "saved_signature",
]

#: One saved tensor: (shape, dtype, device, producer).
SavedSignature = tuple[torch.Size, torch.dtype, torch.device, Any]


#: Attribute remat sets on a tensor it made to stand for a leaf in a recompute (the
#: state guard's linked copy of a parameter the forward wrote): it signs as that leaf.
STANDS_FOR_LEAF = "_remat_stands_for_leaf"


#: Nodes of reshapes that autograd picks between by strides, not by what the code
#: does (``reshape`` records a view or an alias): the same values either way.
_RESHAPES = frozenset({
    "ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0", "AsStridedBackward0",
})


#: Node type -> the producer a signature names for it (`_RESHAPES` as one). Reading a
#: node type's ``__name__`` costs more than the rest of a signature: once per type.
#: Bounded: a custom ``autograd.Function`` defined per call makes a node type per call.
_PRODUCERS: dict[type, Any] = {}
_MAX_PRODUCERS = 4096


def saved_signature(t: torch.Tensor, is_input: bool) -> SavedSignature:
    """The signature of a tensor autograd saves; ``is_input``: a region input."""
    made_by: Any = "input"
    if not is_input:
        node_type = type(t.grad_fn)
        made_by = _PRODUCERS.get(node_type)
        if made_by is None:
            if len(_PRODUCERS) >= _MAX_PRODUCERS:
                _PRODUCERS.clear()
            reshape = getattr(node_type, "__name__", None) in _RESHAPES
            made_by = _PRODUCERS.setdefault(node_type, "a reshape" if reshape else node_type)
    if getattr(t, STANDS_FOR_LEAF, False):
        made_by = type(None)
    return (t.shape, t.dtype, t.device, made_by)


def same_signature(expected: SavedSignature | None, seen: SavedSignature) -> bool:
    """Whether a recompute's saved tensor matches the forward's (NOTE rule 2).

    A producer that is a custom ``autograd.Function`` on one side only is no
    difference: hooks insert identity Functions in the forward alone (FSDP2's
    ``RegisterPostBackwardFunction`` on a unit's inputs), and the values are the
    same; shape, dtype and device must still match.
    """
    if expected is None or expected == seen:
        return expected == seen
    if expected[:3] != seen[:3]:
        return False
    return _custom(expected[3]) or _custom(seen[3])


def _custom(made_by: Any) -> bool:
    custom = torch.autograd.function.BackwardCFunction
    return isinstance(made_by, type) and issubclass(made_by, custom)


def describe_saved(signature: SavedSignature | None) -> str:
    if signature is None:
        return "nothing (the forward saved fewer tensors)"
    shape, dtype, device, made_by = signature
    maker = "a region input" if made_by == "input" else _maker_name(made_by)
    return f"shape {tuple(shape)}, {dtype} on {device}, made by {maker}"


def _maker_name(made_by: Any) -> str:
    if made_by is type(None):
        return "no op (a leaf)"
    return str(getattr(made_by, "__name__", made_by))


def check_saved(
    label: str, index: int, expected: SavedSignature | None, seen: SavedSignature, unread: bool
) -> None:
    """Raise unless the recompute's ``index``-th saved tensor matches the forward's (NOTE rule 2).

    ``unread``: the tensor is a dead op's stand-in (on the meta device) that no
    backward will read; then its shape and dtype are enough.
    """

    def same(forward: SavedSignature | None, recompute: SavedSignature | None) -> bool:
        assert recompute is not None, "this is a bug in remat, please report it"
        if same_signature(forward, recompute):
            return True
        return unread and forward is not None and forward[:2] == recompute[:2]

    expect_same(
        label, f"saved tensor #{index}", expected, seen, same=same, describe=describe_saved,
        hint=SAVED_HINT,
    )


#: After a saved tensor that differs: the forward-only code autograd records.
SAVED_HINT = (
    " (debug=True shows both op logs; code that only the forward runs, under "
    "`if not remat.is_recomputing():`, must not be recorded by autograd, which saves "
    "tensors for it that the recompute does not: run it under `torch.no_grad()`)"
)
