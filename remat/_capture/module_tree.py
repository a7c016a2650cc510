"""A module's subtree as ``named_modules(remove_duplicate=False)`` lists it, kept per module.

The module state guard pins the whole subtree of a region that is a module on
every call (NOTE [ State the forward changes ] in ``module_state.py``), and
``named_modules`` is a recursive generator: a Python call per module per level.
The tree is the same from call to call, so its listing is kept and checked
instead of rebuilt:

NOTE [ The kept module tree ]
1. An entry is, for each module of the listing, its path, a weak reference to
   it, and the names and ids of the children in its ``_modules`` table.
2. It is valid while each module is alive and its ``_modules`` has the same
   names holding the same children (by id), in order. A child assigned,
   replaced, deleted or renamed anywhere in the tree fails the check, and the
   tree is listed again. Ids cannot be reused unseen: every child is itself an
   entry, whose weak reference is dead once it is freed.
3. Only weak references: a kept listing never keeps a module alive. Entries are
   keyed by the root's id with a weak reference to the root checked on lookup,
   and the table holds at most `_MAX_ENTRIES` roots.
"""

from __future__ import annotations

import functools
import threading
import weakref

from torch import nn

__all__ = ["named_subtree"]

_MAX_ENTRIES = 512

#: One module of a kept listing: (its path, a weak reference to it, its children's
#: names and ids in its ``_modules``).
_Node = tuple[str, "weakref.ref[nn.Module]", tuple[str, ...], tuple[int, ...]]

_trees: dict[int, tuple[weakref.ref[nn.Module], list[_Node]]] = {}
_lock = threading.Lock()


def named_subtree(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(module.named_modules(remove_duplicate=False))``, kept while the tree is
    unchanged (NOTE [ The kept module tree ]).

    Examples:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> [name for name, _ in named_subtree(net)]
        ['', '0', '1']
        >>> net[1] = torch.nn.Tanh()  # a replaced child: listed again
        >>> type(named_subtree(net)[2][1]).__name__
        'Tanh'
    """
    entry = _trees.get(id(module))
    if entry is not None and entry[0]() is module:
        listed = _still(entry[1])
        if listed is not None:
            return listed
    nodes: list[_Node] = []
    listed = []
    for path, sub in module.named_modules(remove_duplicate=False):
        table = sub._modules
        nodes.append((path, weakref.ref(sub), tuple(table), tuple(map(id, table.values()))))
        listed.append((path, sub))
    key = id(module)
    with _lock:
        if len(_trees) >= _MAX_ENTRIES:
            _trees.pop(next(iter(_trees)))
        _trees[key] = (weakref.ref(module, functools.partial(_forget, key)), nodes)
    return listed


def _still(nodes: list[_Node]) -> list[tuple[str, nn.Module]] | None:
    """The kept listing, or None if any module of it changed (rule 2)."""
    listed = []
    for path, ref, names, ids in nodes:
        sub = ref()
        if sub is None:
            return None
        table = sub._modules
        if tuple(table) != names or tuple(map(id, table.values())) != ids:
            return None
        listed.append((path, sub))
    return listed


def _forget(key: int, _: weakref.ref[nn.Module]) -> None:
    entry = _trees.get(key)
    if entry is not None and entry[0]() is None:  # not a newer module's entry
        _trees.pop(key, None)
