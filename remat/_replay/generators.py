"""Find the ``torch.Generator``s a region's function reaches, walking once per function.

NOTE [ Explicit generators ] in ``_replay/rng.py`` says what is reached. The walk
meets the same objects on every call of a region (a module's submodules and
flags, the globals its code names), so each function's walk is kept with every
read it made, and the next call re-reads only those (NOTE [ The generator walk
cache ]).

NOTE [ The generator walk cache ]
1. A walk records each read it makes: a mapping's or a sequence's length and
   each item it looks at, a closure cell's contents, an attribute (a function's
   ``__code__``/``__defaults__``, an object's class, a class's ``forward``).
   An item that cannot hold a generator (an int, a string, a tensor: `_ATOMS`)
   is recorded by kind only; any other by identity.
2. The cache is valid while every recorded read gives what it gave: any new,
   removed or rebound attribute, global, cell, submodule, list or dict item on
   the walked path walks again. So a generator bound after the first call (a
   module attribute, a global, a closure cell, an entry of a dict the function
   reaches) is found on the next call.
3. The check holds the read containers and the non-atom values they held, so
   no identity is reused while it is compared; an entry goes when its function
   is collected, and the table keeps at most `_MAX_ENTRIES` functions. A
   function that cannot be weakly referenced is walked on every call.
4. The call's arguments are walked on every call (they change per call).
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["generators_of"]

_MAX_DEPTH = 4
#: Items looked at in one container (a closed-over dataset is no place for generators).
_MAX_ITEMS = 64
#: Values that hold no generator (most of what a walk meets: module flags, sizes).
_ATOMS = frozenset({int, float, bool, str, bytes, type(None), torch.Tensor, torch.nn.Parameter})
#: Functions whose walks are kept (rule 3).
_MAX_ENTRIES = 512

class _Missing:
    """An absent global, attribute or empty cell (weakly referenceable, as reads expect)."""

    __slots__ = ("__weakref__",)


_MISSING = _Missing()
#: Stands for a recorded atom: the read must still give an atom (rule 1).
_ATOM = object()


def _getter(obj: Any) -> Callable[[], Any]:
    """A call that gives ``obj`` back: a weak reference where it takes one (rule 3)."""
    try:
        return weakref.ref(obj)
    except TypeError:  # a dict, a list, None, a cell: held
        return itertools.repeat(obj).__next__


class _Walk:
    """One walk: the generators found and the reads that found them (rule 1).

    The reads are kept in flat columns, so that `unchanged` compares them in C
    (``map``), not item by item in Python.
    """

    def __init__(self) -> None:
        self.found: list[torch.Generator] = []
        self.seen: set[int] = set()
        #: Containers (dicts, lists) and their lengths.
        self.sized: list[Any] = []
        self.lengths: list[int] = []
        #: Per way of reading (``dict.get``, `_item`, ``getattr``, `_own`), the reads
        #: that gave an atom: calls giving the owner, the keys, the atoms' types.
        self.atom_reads: dict[Callable[..., Any], tuple[list[Any], list[Any], list[type]]] = {}
        #: The reads that gave another object: owners, keys, calls giving the object.
        self.obj_reads: dict[Callable[..., Any], tuple[list[Any], list[Any], list[Any]]] = {}
        #: (cell, _ATOM or a call giving what it held).
        self.cells: list[tuple[types.CellType, Any]] = []

    def unchanged(self) -> bool:
        """Whether every read gives what it gave (rule 2)."""
        if list(map(len, self.sized)) != self.lengths:  # first: the indexes are in range
            return False
        for read, (owners, keys, kinds) in self.atom_reads.items():
            now = map(read, map(operator.call, owners), keys, itertools.repeat(_MISSING))
            if list(map(type, now)) != kinds:
                return False
        for read, (owners, keys, getters) in self.obj_reads.items():
            now = map(read, map(operator.call, owners), keys, itertools.repeat(_MISSING))
            # A dead weak reference gives None: the slot holds another object then,
            # "unchanged" only if it is None, which reaches no generator either.
            if not all(map(operator.is_, now, map(operator.call, getters))):
                return False
        for cell, expected in self.cells:
            now = _contents(cell)
            if expected is _ATOM:
                if type(now) not in _ATOMS:
                    return False
            elif now is not expected():
                return False
        return True

    def read(self, read: Callable[..., Any], owner: Any, key: Any, value: Any) -> Any:
        if type(value) in _ATOMS:
            owners, keys, kinds = self.atom_reads.setdefault(read, ([], [], []))
            kinds.append(type(value))
        else:
            owners, keys, getters = self.obj_reads.setdefault(read, ([], [], []))
            getters.append(_getter(value))
        owners.append(_getter(owner))
        keys.append(key)
        return value

    def attr(self, obj: Any, name: str) -> Any:
        return self.read(getattr, obj, name, getattr(obj, name, _MISSING))

    def sized_container(self, container: Any) -> None:
        self.sized.append(container)
        self.lengths.append(len(container))

    def mapping(self, table: dict[Any, Any], depth: int, public: bool = False) -> None:
        self.sized_container(table)
        for key, value in itertools.islice(table.items(), _MAX_ITEMS):
            if public and isinstance(key, str) and key.startswith("_"):
                continue
            self.visit(self.read(dict.get, table, key, value), depth + 1)

    def visit(self, obj: Any, depth: int) -> None:
        if type(obj) in _ATOMS or depth > _MAX_DEPTH or id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        if isinstance(obj, torch.Generator):
            self.found.append(obj)
        elif isinstance(obj, tuple):  # immutable: its items are its identity
            for item in itertools.islice(obj, _MAX_ITEMS):
                self.visit(item, depth + 1)
        elif isinstance(obj, list):
            self.sized_container(obj)
            for i, item in enumerate(itertools.islice(obj, _MAX_ITEMS)):
                self.visit(self.read(_item, obj, i, item), depth + 1)
        elif isinstance(obj, dict):
            self.mapping(obj, depth)
        elif isinstance(obj, functools.partial):
            for name in ("func", "args", "keywords"):
                self.visit(self.attr(obj, name), depth + 1)
        elif isinstance(obj, types.MethodType):  # immutable
            self.visit(obj.__self__, depth + 1)
            self.visit(obj.__func__, depth + 1)
        elif isinstance(obj, types.FunctionType):
            self.function(obj, depth)
        elif isinstance(obj, torch.nn.Module):
            self.module(obj, depth)
        elif hasattr(obj, "__dict__") and not isinstance(
            obj, (type, types.ModuleType, torch.Tensor)
        ):
            cls = self.attr(obj, "__class__")  # a callable object's code: its own
            call = vars(cls).get("__call__", _MISSING)
            self.read(_own, cls, "__call__", call)
            self.mapping(vars(obj), depth)
            self.visit(call, depth + 1)

    def function(self, fn: types.FunctionType, depth: int) -> None:
        for cell in fn.__closure__ or ():  # the closure tuple itself cannot be rebound
            value = _contents(cell)
            self.cells.append((cell, _ATOM if type(value) in _ATOMS else _getter(value)))
            self.visit(value, depth + 1)
        self.visit(self.attr(fn, "__defaults__"), depth + 1)
        self.visit(self.attr(fn, "__kwdefaults__"), depth + 1)
        code = self.attr(fn, "__code__")
        scope = fn.__globals__
        for name in _names(code):
            self.visit(self.read(dict.get, scope, name, scope.get(name, _MISSING)), depth + 1)

    def module(self, module: torch.nn.Module, depth: int) -> None:
        # Its own public attributes and every submodule's, as ``modules()`` finds them.
        subs = list(module.modules())
        self.seen.update(id(sub) for sub in subs)
        for sub in subs:
            children = sub._modules  # submodules added, removed or replaced: walk again
            self.sized_container(children)
            for name, child in children.items():
                self.read(dict.get, children, name, child)
            self.mapping(vars(sub), depth, public=True)
            cls = self.attr(sub, "__class__")
            self.visit(self.attr(cls, "forward"), depth + 1)


#: id(function) -> (a weak reference to it, its walk) (rule 3).
_walks: dict[int, tuple[weakref.ref[Any], _Walk]] = {}
_walks_lock = threading.Lock()


def _walk_of(fn: Any) -> _Walk:
    entry = _walks.get(id(fn))
    if entry is not None and entry[0]() is fn and entry[1].unchanged():
        return entry[1]
    walk = _Walk()
    walk.visit(fn, 0)
    walk.seen = set()  # the next call's leaves start afresh
    try:
        key = id(fn)
        ref = weakref.ref(fn, functools.partial(_forget, key))
    except TypeError:  # not weakly referenceable: walked on every call
        return walk
    with _walks_lock:
        if len(_walks) >= _MAX_ENTRIES:
            _walks.pop(next(iter(_walks)))
        _walks[key] = (ref, walk)
    return walk


def _item(seq: list[Any], index: int, default: Any) -> Any:
    return seq[index]  # in range: the lengths are compared first


def _own(cls: type, name: str, default: Any) -> Any:
    return vars(cls).get(name, default)  # defined by the class itself, not inherited


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


def _forget(key: int, _: weakref.ref[Any]) -> None:
    entry = _walks.get(key)
    if entry is not None and entry[0]() is None:  # not a newer function's entry
        _walks.pop(key, None)


def generators_of(fn: Any, leaves: Iterable[Any] = ()) -> list[torch.Generator]:
    """The ``torch.Generator``s a region's call can reach (NOTE [ Explicit generators ]).

    Examples:
        >>> import torch
        >>> gen = torch.Generator()
        >>> generators_of(lambda x: torch.rand(2, generator=gen)) == [gen]
        True
    """
    found = list(_walk_of(fn).found)
    known = {id(g) for g in found}
    for leaf in leaves:
        if type(leaf) in _ATOMS:
            continue
        walk = _Walk()
        walk.visit(leaf, 0)
        found.extend(g for g in walk.found if id(g) not in known)
        known.update(id(g) for g in walk.found)
    return found


@functools.lru_cache(maxsize=1024)
def _names(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` (and code nested in it) may look up as globals."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_names(const))
    return tuple(dict.fromkeys(names))
