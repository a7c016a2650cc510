"""optree glue: pytrees of arguments and outputs, where the leaves that matter are tensors.

``None`` is a leaf here (``none_is_leaf=True``), so an argument that is ``None``
keeps its place when a tree is flattened and rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

__all__ = ["flatten", "tensor_leaves", "tree_map", "unflatten"]


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``, in flattening order."""
    leaves: list[Any] = optree.tree_leaves(tree, none_is_leaf=True)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply ``fn`` to every leaf of ``tree`` (``None`` included)."""
    return optree.tree_map(fn, tree, none_is_leaf=True)


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """Leaves and the structure to rebuild ``tree`` with `unflatten`."""
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    return list(leaves), spec


def unflatten(spec: Any, leaves: list[Any]) -> Any:
    """Rebuild a tree flattened by `flatten` from new leaves."""
    return optree.tree_unflatten(spec, leaves)
