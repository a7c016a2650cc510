"""Find the ``torch.Generator``s a region's function reaches, walking once per function.

NOTE [ Explicit generators ] in ``_replay/rng.py`` says what is reached. The walk
meets the same objects on every call of a region (a module's submodules and
flags, the globals its code names), so each function's walk is kept as the
list of reads it made, and the next call replays only those (NOTE [ The
generator walk cache ]).

NOTE [ The generator walk cache ]
1. A walk records each read it makes as a step from an earlier step's value
   (the function is value 0): a dict's or a sequence's length and each item it
   looks at, a closure cell's contents, an attribute (a function's ``__code__``,
   ``__defaults__`` and ``__globals__``, a module's ``_modules`` and
   ``__dict__``, an object's class, a class's ``forward``), and what the value
   must be: an atom (an int, a string, a tensor: `_ATOMS`, which hold no
   generator), of the same type (a container or an object the walk went into,
   whose contents later steps read), the same object as an earlier step's
   (the walk met it twice), or the same generator, class or code object.
2. The cache is valid while replaying the steps from the function gives what
   they gave: any new, removed or rebound attribute, global, cell, submodule,
   list or dict item on the walked path walks again. So a generator bound after
   the first call (a module attribute, a global, a closure cell, an entry of a
   dict the function reaches) is found on the next call.
3. A walk references strongly only the generators it found, and classes and
   code objects that take no weak reference; the function, classes and code
   objects weakly, containers not at all (each replay reads them afresh from
   the function). So a cycle through a kept walk cannot keep a function
   alive: an entry goes when its function is collected, and the table keeps at
   most `_MAX_ENTRIES` functions. A function that takes no weak reference is
   walked on every call.
4. The call's arguments are walked on every call (they change per call).
"""

from __future__ import annotations

import functools
import itertools
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = [
    "MISSING",
    "MODULE_OWN",
    "Walk",
    "generators_of",
    "holds_tensor",
    "module_tensors",
    "walk_of",
    "walks_private",
]

_MAX_DEPTH = 4
#: Items looked at in one container (a closed-over dataset is no place for generators).
_MAX_ITEMS = 64
#: Values that hold no generator (most of what a walk meets: module flags, sizes).
_ATOMS = frozenset({int, float, bool, str, bytes, type(None), torch.Tensor, torch.nn.Parameter})
#: Functions whose walks are kept (rule 3).
_MAX_ENTRIES = 512
#: A module's own bookkeeping (``_parameters``, ``_modules``, its hooks, ``training``):
#: read through the module's tables, never as attributes. Any other attribute may
#: hold what a region reads, a private one (``self._mask``) included.
MODULE_OWN = frozenset(vars(torch.nn.Module()))
#: What a module's private attribute holds that a walk reads (`walks_private`): a
#: tensor or a generator, or plain data that may hold one (``self._cache = {"k": t}``).
_PRIVATE_WALKED = (torch.Tensor, torch.Generator)
_PLAIN_DATA = (dict, list, tuple, types.SimpleNamespace)


def walks_private(module: torch.nn.Module, value: Any) -> bool:
    """Whether a walk reads ``value``, a private attribute of ``module`` (both engines'
    walks): a tensor, a generator, or plain data (a dict, list, tuple or namespace),
    but not the callables libraries keep there (Hugging Face's
    ``_gradient_checkpointing_func``, which reaches a checkpoint function's globals),
    nor a module's own view of its tables (an RNN's ``_flat_weights``, its parameters:
    the module state guard has them, and ``functional_call`` rewrites the list)."""
    if isinstance(value, _PRIVATE_WALKED):
        return True
    if not isinstance(value, _PLAIN_DATA):
        return False
    own = {id(t) for t in module._parameters.values()}
    own.update(id(t) for t in module._buffers.values())
    items = vars(value).values() if isinstance(value, types.SimpleNamespace) else (
        value.values() if isinstance(value, dict) else value
    )
    return not any(id(item) in own for item in itertools.islice(items, _MAX_ITEMS))


def holds_tensor(value: Any) -> bool:
    """A tensor, or a dict, list or tuple with a tensor among its items (a class's or
    an imported module's table: ``TABLE = {"mask": t}``)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return False
    return any(isinstance(v, torch.Tensor) for v in itertools.islice(value, _MAX_ITEMS))


def module_tensors(module: types.ModuleType, names: Iterable[str]) -> list[tuple[str, Any]]:
    """The tensors among ``module``'s attributes that code naming ``names`` can read
    (``tables.MASK``: both names are in the code's names), and the dicts, lists and
    tuples holding one (``tables.MASKS["causal"]``)."""
    table = vars(module)
    return [(name, table[name]) for name in names if holds_tensor(table.get(name))]


class _Missing:
    """An absent global, attribute or empty cell."""

    __slots__ = ()


MISSING = _Missing()

# How a step reads its value from an earlier one (rule 1).
_GET, _ITEM, _ATTR, _CELL, _LEN, _VARS, _OWN = range(7)
# What the value must be: an atom, anything (past the depth), of the same type,
# the same object as an earlier step's, the object a call gives (a weak reference).
_IS_ATOM, _ANY, _TYPE, _SAME, _IS, _SAME_AS_MISSING = range(6)


def _is_atom(value: Any) -> bool:
    # A tensor of any type holds no generator, and is never weakly referenced
    # here (``torch.utils.swap_tensors`` refuses a tensor that is).
    return type(value) in _ATOMS or isinstance(value, torch.Tensor)


def _getter(obj: Any) -> Callable[[], Any]:
    """A call that gives ``obj`` back: a weak reference where it takes one (rule 3)."""
    try:
        return weakref.ref(obj)
    except TypeError:  # a class or code object without weak references: held
        return itertools.repeat(obj).__next__


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return MISSING


#: What a ``_GET`` step reads: every one is a dict (a dict subclass may redefine
#: ``get``: transformers' ``_CanRecordRegistry.get(model)`` takes no default).
_dict_get = dict.get


def _read(obj: Any, op: int, key: Any) -> Any:
    if op == _GET:
        return _dict_get(obj, key, MISSING)
    if op == _ITEM:
        return obj[key] if key < len(obj) else MISSING
    if op == _ATTR:
        return getattr(obj, key, MISSING)
    if op == _CELL:
        return _contents(obj)
    if op == _VARS:
        return vars(obj)
    return vars(obj).get(key, MISSING)  # _OWN: defined by the class itself


class Walk:
    """One walk: the generators found and the steps that found them (rule 1)."""

    def __init__(self) -> None:
        self.found: list[torch.Generator] = []
        #: id of each object the walk went into -> its step's value index.
        self.seen: dict[int, int] = {}
        #: (source value index, how read, key, what it must be, expected).
        self.steps: list[tuple[int, int, Any, int, Any]] = []
        #: The value indexes of the steps that gave a tensor: bindings the eager
        #: engine reads again for its recompute (NOTE [ Bindings the recompute
        #: reads ] in ``_engines/eager/bindings.py``).
        self.tensor_steps: list[int] = []
        #: The value indexes of the steps that gave a module: the function itself or a
        #: submodule (the same NOTE, rules 5 and 7).
        self.module_steps: list[int] = []

    def unchanged(self, root: Any) -> bool:
        """Whether replaying the steps from ``root`` gives what they gave (rule 2)."""
        values = [root]
        for src, op, key, kind, expected in self.steps:
            obj = values[src]
            if op == _LEN:
                if len(obj) != key:
                    return False
                values.append(None)
                continue
            if op == _GET:  # inline, not `_read`: this loop is the cache's whole cost
                now = _dict_get(obj, key, MISSING)
            elif op == _ATTR:
                now = getattr(obj, key, MISSING)
            else:
                now = _read(obj, op, key)
            if kind == _IS_ATOM:
                if type(now) not in _ATOMS and not isinstance(now, torch.Tensor):
                    return False
            elif kind == _SAME_AS_MISSING:
                if now is not MISSING:
                    return False
            elif kind == _TYPE:
                if type(now) is not expected:
                    return False
            elif kind == _SAME:
                if now is not values[expected]:
                    return False
            elif kind == _IS and now is not expected():
                return False
            values.append(now)
        return True

    def read_tensors(self, root: Any) -> list[Any]:
        """What each of `tensor_steps` gives now, replaying only the steps on its path
        (`MISSING` where a step on it gives nothing now)."""
        return self.read_steps(root, self.tensor_steps)

    def read_steps(self, root: Any, steps: list[int]) -> list[Any]:
        """What each of ``steps`` gives now (`read_tensors`)."""
        values: dict[int, Any] = {0: root}
        return [self._value(index, values) for index in steps]

    def _value(self, index: int, values: dict[int, Any]) -> Any:
        if index in values:
            return values[index]
        src, op, key, _, _ = self.steps[index - 1]
        obj = self._value(src, values)
        try:
            now = MISSING if obj is MISSING else _read(obj, op, key)
        except (TypeError, AttributeError, KeyError):  # not the container it was
            now = MISSING
        values[index] = now
        return now

    def describe(self, root: Any, index: int) -> str:
        """Step ``index``'s binding in words: "global 'STATE' ['w']", "closure variable 'w'"."""
        path: list[int] = []
        while index:
            path.append(index)
            index = self.steps[index - 1][0]
        values: dict[int, Any] = {0: root}
        words: list[str] = []
        last = -1
        for at in reversed(path):
            src, op, key, _, _ = self.steps[at - 1]
            after_vars, last = last == _VARS, op
            if op == _ATTR and key == "_modules":
                last = _VARS  # a submodule reads as an attribute: ``.lin``
            elif op == _ATTR and key == "__globals__":
                words.append("global")
            elif op == _ATTR and key == "__closure__":
                words.append("closure variable")
            elif op == _ITEM and words[-1:] == ["closure variable"]:
                # ``src`` is the closure tuple's step, read from the function's value.
                code = getattr(self._value(self.steps[src - 1][0], values), "__code__", None)
                names = code.co_freevars if code is not None else ()
                words.append(repr(names[key]) if key < len(names) else f"#{key}")
            elif op in (_GET, _ITEM):
                if words[-1:] == ["global"]:
                    words.append(repr(key))
                else:  # an attribute, read from the object's ``__dict__``, or an item
                    words.append(f".{key}" if after_vars else f"[{key!r}]")
            elif op in (_ATTR, _OWN):  # _OWN: a class attribute, from the class's table
                words.append(f".{key}")
            # _CELL, _VARS, _LEN: no words of their own
        return " ".join(words).replace(" [", "[").replace(" .", ".")

    def _record(self, src: int, op: int, key: Any, kind: int, expected: Any) -> int:
        self.steps.append((src, op, key, kind, expected))
        return len(self.steps)  # the index of its value (value 0 is the function)

    def length(self, src: int, container: Any) -> None:
        self._record(src, _LEN, len(container), _ANY, None)

    def part(self, src: int, op: int, key: Any, value: Any) -> int:
        """A structural read the walk does not go into (a table of globals, a ``__dict__``)."""
        return self._record(src, op, key, _TYPE, type(value))

    def step(self, src: int, op: int, key: Any, value: Any, depth: int) -> None:
        """Read ``value`` from value ``src`` and walk it, as the walk of old visited it."""
        if _is_atom(value):
            index = self._record(src, op, key, _IS_ATOM, None)
            if isinstance(value, torch.Tensor):
                self.tensor_steps.append(index)
        elif value is MISSING:  # most names a function's code holds are no globals
            self._record(src, op, key, _SAME_AS_MISSING, None)
        elif depth > _MAX_DEPTH:
            self._record(src, op, key, _ANY, None)
        elif id(value) in self.seen:
            self._record(src, op, key, _SAME, self.seen[id(value)])
        elif isinstance(value, torch.Generator):
            self.seen[id(value)] = self._record(src, op, key, _IS, _getter(value))
            self.found.append(value)
        else:
            at = self.seen[id(value)] = self._record(src, op, key, _TYPE, type(value))
            self.into(at, value, depth)

    def into(self, at: int, obj: Any, depth: int) -> None:
        """Walk the parts of ``obj``, the value of step ``at``."""
        if isinstance(obj, (tuple, list)):
            self.length(at, obj)
            for i, item in enumerate(itertools.islice(obj, _MAX_ITEMS)):
                self.step(at, _ITEM, i, item, depth + 1)
        elif isinstance(obj, dict):
            self.length(at, obj)
            for key, value in itertools.islice(obj.items(), _MAX_ITEMS):
                self.step(at, _GET, key, value, depth + 1)
        elif isinstance(obj, functools.partial):
            for name in ("func", "args", "keywords"):
                self.step(at, _ATTR, name, getattr(obj, name), depth + 1)
        elif isinstance(obj, types.MethodType):
            self.step(at, _ATTR, "__self__", obj.__self__, depth + 1)
            self.step(at, _ATTR, "__func__", obj.__func__, depth + 1)
        elif isinstance(obj, types.FunctionType):
            self.function(at, obj, depth)
        elif isinstance(obj, torch.nn.Module):
            self.module(at, obj, depth)
        elif hasattr(obj, "__dict__") and not isinstance(
            obj, (type, types.ModuleType, torch.Tensor)
        ):
            cls = self._record(at, _ATTR, "__class__", _IS, _getter(type(obj)))
            # A callable object's code: its class's own ``__call__``.
            self.step(cls, _OWN, "__call__", vars(type(obj)).get("__call__", MISSING), depth + 1)
            self.step(at, _VARS, None, vars(obj), depth + 1)

    def function(self, at: int, fn: types.FunctionType, depth: int) -> None:
        closure = self.part(at, _ATTR, "__closure__", fn.__closure__)
        cells = fn.__closure__ or ()
        if fn.__closure__ is not None:  # else its type, None, is checked
            self.length(closure, cells)
        for i, cell in enumerate(cells):
            held = self.part(closure, _ITEM, i, cell)
            self.step(held, _CELL, None, _contents(cell), depth + 1)
        self.step(at, _ATTR, "__defaults__", fn.__defaults__, depth + 1)
        self.step(at, _ATTR, "__kwdefaults__", fn.__kwdefaults__, depth + 1)
        self._record(at, _ATTR, "__code__", _IS, _getter(fn.__code__))
        scope = self.part(at, _ATTR, "__globals__", fn.__globals__)
        names = _names(fn.__code__)
        for name in names:
            value = fn.__globals__.get(name, MISSING)
            self.step(scope, _GET, name, value, depth + 1)
            if isinstance(value, types.ModuleType) and id(value) in self.seen:
                self.module_attributes(self.seen[id(value)], value, names, depth + 1)

    def module_attributes(
        self, at: int, module: types.ModuleType, names: Iterable[str], depth: int
    ) -> None:
        """The tensor attributes of an imported module that the code names (``tables.MASK``)."""
        found = module_tensors(module, names)
        if found:
            table = self.part(at, _VARS, None, vars(module))
            for name, tensor in found:
                self.step(table, _GET, name, tensor, depth + 1)

    def module(self, at: int, module: torch.nn.Module, depth: int) -> None:
        # Its own public attributes and every submodule's, as ``modules()`` finds
        # them, each at the depth after the module's.
        if at not in self.module_steps:  # the function itself, a global, a method's self
            self.module_steps.append(at)
        pending = [(at, module)]
        while pending:
            where, sub = pending.pop(0)
            children = self.part(where, _ATTR, "_modules", sub._modules)
            self.length(children, sub._modules)
            for name, child in sub._modules.items():
                if child is None or id(child) in self.seen:
                    self.step(children, _GET, name, child, depth)  # an atom, or seen
                    continue
                self.seen[id(child)] = index = self.part(children, _GET, name, child)
                self.module_steps.append(index)
                pending.append((index, child))
            table = self.part(where, _VARS, None, vars(sub))
            self.length(table, vars(sub))
            for key, value in itertools.islice(vars(sub).items(), _MAX_ITEMS):
                if key in MODULE_OWN or (
                    isinstance(key, str) and key.startswith("_") and not walks_private(sub, value)
                ):
                    continue
                self.step(table, _GET, key, value, depth + 1)
            cls = self._record(where, _ATTR, "__class__", _IS, _getter(type(sub)))
            self.step(cls, _ATTR, "forward", type(sub).forward, depth + 1)
            for key, value in vars(type(sub)).items():  # ``class Block: mask = ...``
                if holds_tensor(value):
                    self.step(cls, _OWN, key, value, depth + 1)


#: id(function) -> (a weak reference to it, its walk) (rule 3).
_walks: dict[int, tuple[weakref.ref[Any], Walk]] = {}
_walks_lock = threading.Lock()


def walk_of(fn: Any) -> Walk:
    """The walk of what ``fn`` reaches: the kept one while replaying it gives what it gave."""
    entry = _walks.get(id(fn))
    if entry is not None and entry[0]() is fn and entry[1].unchanged(fn):
        return entry[1]
    walk = Walk()
    if not _is_atom(fn):
        walk.seen[id(fn)] = 0
        walk.into(0, fn, 0)
    walk.seen = {}  # ids are compared only while walking
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


def _forget(key: int, _: weakref.ref[Any]) -> None:
    entry = _walks.get(key)
    if entry is not None and entry[0]() is None:  # not a newer function's entry
        _walks.pop(key, None)


def generators_of(
    fn: Any, leaves: Iterable[Any] = (), walk: Walk | None = None
) -> list[torch.Generator]:
    """The ``torch.Generator``s a region's call can reach (NOTE [ Explicit generators ]).

    ``walk``: `walk_of(fn)`, where the caller has it already.

    Examples:
        >>> import torch
        >>> gen = torch.Generator()
        >>> generators_of(lambda x: torch.rand(2, generator=gen)) == [gen]
        True
    """
    found = list((walk or walk_of(fn)).found)
    known = {id(g) for g in found}
    for leaf in leaves:
        if _is_atom(leaf):
            continue
        walk = Walk()
        walk.step(0, _ATTR, None, leaf, 0)
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
