"""optree glue: pytrees of arguments and outputs, where the leaves that matter are tensors.

NOTE [ Containers remat sees into ]
1. ``None`` is a leaf in `flatten`/`tensor_leaves`/`tree_map` (``none_is_leaf=True``),
   so an argument that is ``None`` keeps its place when a tree is flattened and
   rebuilt.
2. `flatten_region_io` flattens a region's arguments and outputs. Besides what
   optree knows (tuples, lists, dicts, namedtuples, ``OrderedDict``, types
   registered in the global namespace), it sees into, in this order: types
   registered in the ``"remat"`` namespace (`NAMESPACE`); types registered with
   ``torch.utils._pytree`` (Hugging Face registers every ``ModelOutput`` there);
   dataclasses; and subclasses of ``dict``, ``list`` and ``tuple``. An
   unregistered type is registered in the ``"remat"`` namespace the first time it
   is met (no namespace a user flattens with changes). Rebuilt objects have the
   same type and the same non-tensor fields: they are made with ``cls.__new__``
   and filled field by field, without running ``__init__``/``__post_init__``.
3. Under the torch.func engine an output tensor that no flattening reaches is
   invisible to the `autograd.Function` (its gradient is silently zero), so
   `opaque_tensor_path` finds tensors held by the leaves that are left (plain
   objects' attributes and slots, containers inside them) and the engines raise
   `RematError` with `opaque_output_message`. Both engines raise, so a region
   behaves the same under ``loss.backward()`` and under ``torch.func``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import types
from collections.abc import Callable
from typing import Any

import optree
import torch

from ._compat import torch_pytree_node
from ._errors import RematError

__all__ = [
    "NAMESPACE",
    "check_outputs_visible",
    "flatten",
    "flatten_region_io",
    "opaque_output_message",
    "opaque_tensor_path",
    "tensor_leaves",
    "tree_map",
    "unflatten",
]

#: The optree namespace remat flattens arguments and outputs with.
NAMESPACE = "remat"

_MAX_DEPTH = 6
_lock = threading.Lock()
_registered: set[type] = set()


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
    """Rebuild a tree flattened by `flatten` (or `flatten_region_io`) from new leaves."""
    return optree.tree_unflatten(spec, leaves)


def flatten_region_io(tree: Any) -> tuple[list[Any], Any]:
    """Flatten arguments or outputs, seeing into the containers of NOTE rule 2.

    ``None`` is not a leaf here (it holds no tensor); rebuild with `unflatten`.
    """
    while True:
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)
        # Only types seen holding a tensor: a ``torch.Size`` stays one leaf.
        new = {
            type(leaf)
            for leaf in leaves
            if _can_register(leaf) and opaque_tensor_path(leaf) is not None
        }
        if not new:
            return list(leaves), spec
        for cls in new:
            _register(cls)


# ---------------------------------------------------------------------------
# Registering containers in the "remat" namespace
# ---------------------------------------------------------------------------


def _can_register(leaf: Any) -> bool:
    cls = type(leaf)
    if isinstance(leaf, torch.Tensor) or cls in _registered:
        return False
    return (
        torch_pytree_node(cls) is not None
        or (dataclasses.is_dataclass(leaf) and not isinstance(leaf, type))
        or isinstance(leaf, (dict, list, tuple))
    )


def _register(cls: type) -> None:
    flatten_fn, unflatten_fn = _flatteners(cls)
    with _lock:
        if cls in _registered:
            return
        optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)
        _registered.add(cls)


_Flatten = Callable[[Any], tuple[list[Any], Any]]
_Unflatten = Callable[[Any, Any], Any]


def _flatteners(cls: type) -> tuple[_Flatten, _Unflatten]:
    node = torch_pytree_node(cls)
    if node is not None:
        return _torch_flatteners(node)
    if issubclass(cls, dict):
        return _mapping_flatteners(cls)
    if issubclass(cls, (list, tuple)):
        return _sequence_flatteners(cls)
    return _attribute_flatteners(cls)


def _torch_flatteners(node: Any) -> tuple[_Flatten, _Unflatten]:
    # torch's node: flatten_fn(obj) -> (children, context); unflatten_fn(children, context).
    def flatten_fn(obj: Any) -> tuple[list[Any], Any]:
        children, context = node.flatten_fn(obj)
        return list(children), context

    def unflatten_fn(context: Any, children: Any) -> Any:
        return node.unflatten_fn(list(children), context)

    return flatten_fn, unflatten_fn


def _attribute_names(obj: Any, skip: set[str]) -> tuple[str, ...]:
    """Dataclass fields, then other instance attributes, minus ``skip``."""
    names: list[str] = []
    if dataclasses.is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj) if hasattr(obj, f.name)]
    names += [k for k in getattr(obj, "__dict__", {}) if k not in names]
    return tuple(n for n in names if n not in skip)


def _set_attributes(obj: Any, names: tuple[str, ...], values: Any) -> None:
    for name, value in zip(names, values, strict=True):
        object.__setattr__(obj, name, value)  # also for frozen dataclasses


def _attribute_flatteners(cls: Any) -> tuple[_Flatten, _Unflatten]:
    def flatten_fn(obj: Any) -> tuple[list[Any], Any]:
        names = _attribute_names(obj, set())
        return [getattr(obj, n) for n in names], names

    def unflatten_fn(names: tuple[str, ...], children: Any) -> Any:
        obj: Any = cls.__new__(cls)
        _set_attributes(obj, names, children)
        return obj

    return flatten_fn, unflatten_fn


def _mapping_flatteners(cls: Any) -> tuple[_Flatten, _Unflatten]:
    # Filled through the builtin base's own methods (an ``OrderedDict`` keeps its
    # order in a list ``dict.update`` does not see), never the subclass's.
    base: Any = collections.OrderedDict if issubclass(cls, collections.OrderedDict) else dict

    # Attributes that are the item of the same name (a dataclass that is also a
    # dict) are one leaf: the rebuilt object gets the item's new value for both.
    def flatten_fn(obj: Any) -> tuple[list[Any], Any]:
        keys = tuple(obj.keys())
        aliased = {k for k in keys if isinstance(k, str) and getattr(obj, k, None) is obj[k]}
        names = _attribute_names(obj, aliased)
        children = [dict.__getitem__(obj, k) for k in keys] + [getattr(obj, n) for n in names]
        return children, (keys, names, tuple(sorted(aliased)))

    def unflatten_fn(context: Any, children: Any) -> Any:
        keys, names, aliased = context
        values = list(children)
        obj = cls.__new__(cls)
        base.update(obj, zip(keys, values[: len(keys)], strict=True))
        _set_attributes(obj, names, values[len(keys) :])
        _set_attributes(obj, aliased, [dict.__getitem__(obj, k) for k in aliased])
        return obj

    return flatten_fn, unflatten_fn


def _sequence_flatteners(cls: Any) -> tuple[_Flatten, _Unflatten]:
    base: Any = tuple if issubclass(cls, tuple) else list

    def flatten_fn(obj: Any) -> tuple[list[Any], Any]:
        names = _attribute_names(obj, set())
        items = list(base.__iter__(obj))
        return items + [getattr(obj, n) for n in names], (len(items), names)

    def unflatten_fn(context: Any, children: Any) -> Any:
        count, names = context
        values = list(children)
        obj: Any
        if base is tuple:
            obj = tuple.__new__(cls, values[:count])
        else:
            obj = cls.__new__(cls)
            list.extend(obj, values[:count])
        _set_attributes(obj, names, values[count:])
        return obj

    return flatten_fn, unflatten_fn


# ---------------------------------------------------------------------------
# Tensors no flattening reaches (NOTE rule 3)
# ---------------------------------------------------------------------------

_SCALARS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)
_NOT_DATA = (type, types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module)


def opaque_tensor_path(leaf: Any) -> str | None:
    """Where ``leaf`` (a non-tensor leaf) holds a tensor (``".cache[0]"``), or None.

    Modules are skipped: their tensors are parameters and buffers, which are no
    region outputs.
    """
    return _find_tensor(leaf, "", 0, set())


def _find_tensor(obj: Any, path: str, depth: int, seen: set[int]) -> str | None:
    if isinstance(obj, torch.Tensor):
        return path or "itself"
    if depth > _MAX_DEPTH or isinstance(obj, _SCALARS + _NOT_DATA) or id(obj) in seen:
        return None
    seen.add(id(obj))
    for key, value in _children(obj):
        found = _find_tensor(value, f"{path}{key}", depth + 1, seen)
        if found is not None:
            return found
    return None


def _children(obj: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        out += [(f"[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        out += [(f"[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(obj, (set, frozenset)):
        out += [("[...]", v) for v in obj]
    out += [(f".{k}", v) for k, v in getattr(obj, "__dict__", {}).items()]
    for klass in type(obj).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                try:
                    out.append((f".{name}", object.__getattribute__(obj, name)))
                except AttributeError:
                    continue
    return out


def check_outputs_visible(leaves: list[Any], label: str) -> None:
    """Raise `RematError` if a non-tensor output leaf holds a tensor (NOTE rule 3)."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            continue
        path = opaque_tensor_path(leaf)
        if path is not None:
            raise RematError(opaque_output_message(label, leaf, path))


def opaque_output_message(label: str, leaf: Any, path: str) -> str:
    """The `RematError` text for an output object holding a tensor remat cannot see."""
    cls = type(leaf)
    name = f"{cls.__module__}.{cls.__qualname__}"
    return (
        f"remat: {label} returns a {name} object that holds a tensor "
        f"({cls.__qualname__}{path if path != 'itself' else ''}) remat cannot see into: "
        "under torch.func that tensor would not be an output of the region and its "
        "gradient would silently be zero. Register the type as a pytree, e.g. "
        f"optree.register_pytree_node({cls.__qualname__}, flatten_func, unflatten_func, "
        f"namespace={NAMESPACE!r}) (or torch.utils._pytree.register_pytree_node), make "
        "it a dataclass, or return its tensors in a tuple, list or dict."
    )
