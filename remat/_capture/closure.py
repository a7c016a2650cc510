"""Find the tensors a function closes over, so an `autograd.Function` can take them as inputs.

NOTE [ Closed-over tensors ]
1. An `autograd.Function` sees only the tensors passed to ``apply``. Under
   ``torch.func.grad`` a tensor that ``fn`` reaches any other way (a closure
   cell, a module parameter, a global) is not differentiated: its gradient comes
   back as silent zeros. So before the call we walk what ``fn`` can reach and
   collect every tensor that some transform or eager autograd tracks (a
   functorch-wrapped tensor, or one that requires grad).
2. Each found tensor lives in a *slot* that can be read and written: a closure
   cell, a module's ``_parameters``/``_buffers`` entry, an object attribute, a
   global, or a leaf of a list/tuple/dict held in one of those. The engine passes
   the tensors as explicit inputs. Nothing is written to a slot: ``fn`` runs on
   the user's own objects, and the engine's per-thread `TorchFunctionMode`
   substitutes, at each op, the Function's view for each found tensor (by
   identity). Another thread reading the same global or parameter never sees
   the engine's views, and what ``fn`` does to a container stays done.
3. What we walk: ``functools.partial`` (its function), bound methods (``__self__``
   and ``__func__``), functions (closure cells, default arguments, and the
   globals their code, and code nested in it, names), ``nn.Module``s (every
   parameter, buffer and plain tensor attribute of every submodule, and the code
   of ``forward``), other callable objects (their attributes and ``__call__``),
   and, up to a depth, plain objects and containers held in any of those (an
   attribute of an attribute, an object in a list). A module's private
   attributes count too (``self._mask``, ``self._cos_cached``: tensors only,
   not the callables libraries keep there, such as Hugging Face's
   ``_gradient_checkpointing_func``, nor containers such as an RNN's
   ``_flat_weights``, its own list of its parameters; a module's own tables
   `MODULE_OWN` are walked as parameters and buffers), and so do the tensors its
   class holds (``class Block: mask = torch.ones(4)``), and a tensor attribute of
   an imported module the code names (``tables.MASK``). Anything else (a tensor
   in a ``__slots__`` object, a tensor reached through a function call's return
   value, an attribute two modules deep) is not found; the engine's guard then
   raises `RematError` for a tracked one instead of returning a wrong gradient.
4. Snapshot. Each slot remembers its value at the call (the leaves and structure
   of a container, untracked leaves included); while ``fn`` is recomputed its
   ops see that snapshot with the Function's inputs substituted, so a list
   appended to or a variable rebound between forward and backward does not
   change what the recompute computes. Slots holding one untracked tensor (a
   frozen parameter, a plain closed-over constant) are snapshotted too:
   ``torch.func.functional_call`` puts a module's own tensors back before the
   backward runs, and the recompute must still see the ones the forward saw.
   Nothing is written to the slot: a slot that keeps its structure maps the
   tensor now in it to what the forward saw there (`Bindings.remap`); a
   container whose structure changed is covered by the engine's trace of
   which op read which input (NOTE [ The functional engine ] rule 2). What a
   recompute stores in a slot (``self.last = h``) stays, as under the eager
   engine: guard such effects with `remat.is_recomputing`.
5. Arguments. A region's arguments are flattened as pytrees (NOTE [ Containers
   remat sees into ] in ``_pytree.py``); an argument leaf that is still an object
   (a config object, a module passed in) is walked like an object ``fn`` reaches,
   so its tensors become inputs, substituted op by op like the others.
6. A slot the forward itself rebinds (a rotary cache grown for a longer
   sequence, an attribute or a buffer registered again, with a Python
   ``maxlen`` beside it) without any op reading the tensor it held at the call
   (`Bindings.note_versions` knows which ones the ops read) is read by the
   recompute as the forward left it (`Slot.left`): rule 4's snapshot would give
   the recompute the old table while ``maxlen`` says not to grow it. One
   rebound again after the forward maps to what the forward left, and one
   written in place after it raises. A slot the forward reads and then
   rebinds (a running average) keeps rule 4: the recompute reads the start
   tensor, as the forward did, and rebinds it again. (The eager engine's rule:
   NOTE [ Bindings the recompute reads ] rule 8.)
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from .._replay.generators import MODULE_OWN, holds_tensor, module_tensors, walks_private
from .bindings import Bindings, Slot, is_tracked
from .stateful import is_stateful

__all__ = ["Bindings", "find_closed_over", "is_tracked"]

_MAX_DEPTH = 8
#: Values that hold no tensor and own no attributes worth walking.
_ATOMS = frozenset(
    {int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device,
     types.ModuleType}
)
_PYTREE_TYPES = (list, tuple, dict)


def find_closed_over(
    fn: Callable[..., Any], objects: Sequence[tuple[Any, str]] = ()
) -> Bindings:
    """Walk what ``fn`` reaches (NOTE [ Closed-over tensors ]) and bind its tracked tensors.

    ``objects`` are (object, where) pairs walked as well, as an object ``fn``
    reaches would be: the arguments no pytree flattening sees into (rule 5).
    """
    bindings = Bindings()
    walker = _Walker(bindings)
    walker.callable(fn, _name(fn), 0)
    for obj, where in objects:
        walker.value_owner(obj, where, 1)
    return bindings


def _name(obj: Any) -> str:
    return str(getattr(obj, "__qualname__", None) or type(obj).__qualname__)


class _Walker:
    def __init__(self, bindings: Bindings) -> None:
        self.bindings = bindings
        self.seen: set[int] = set()

    def first_visit(self, obj: Any) -> bool:
        if id(obj) in self.seen:
            return False
        self.seen.add(id(obj))
        return True

    def callable(self, fn: Any, where: str, depth: int) -> None:
        if depth > _MAX_DEPTH or not self.first_visit(fn):
            return
        if isinstance(fn, torch.nn.Module):
            self.module(fn, where, depth)
            forward = type(fn).forward
            if isinstance(forward, types.FunctionType):
                self.function(forward, f"{type(fn).__qualname__}.forward", depth + 1)
        elif isinstance(fn, functools.partial):
            self.callable(fn.func, where, depth + 1)
        elif isinstance(fn, types.MethodType):
            self.value_owner(fn.__self__, f"{where}.__self__", depth + 1)
            self.callable(fn.__func__, where, depth + 1)
        elif isinstance(fn, types.FunctionType):
            self.function(fn, where, depth)
        elif hasattr(fn, "__dict__") and not isinstance(fn, type):
            self.attributes(fn, where, depth)
            call = next(
                (vars(k)["__call__"] for k in type(fn).__mro__ if "__call__" in vars(k)), None
            )
            if isinstance(call, types.FunctionType):
                self.function(call, f"{type(fn).__qualname__}.__call__", depth + 1)

    def value_owner(self, obj: Any, where: str, depth: int) -> None:
        """Walk an object that may hold tensors in its attributes (or attributes of those)."""
        if isinstance(obj, torch.nn.Module):
            self.callable(obj, where, depth)
        elif isinstance(obj, (types.FunctionType, functools.partial, types.MethodType)):
            self.callable(obj, _name(obj), depth)
        elif (
            depth <= _MAX_DEPTH
            and hasattr(obj, "__dict__")
            and not isinstance(obj, (type, types.ModuleType, torch.Tensor))
            and self.first_visit(obj)
        ):
            self.attributes(obj, where, depth)

    def function(self, fn: types.FunctionType, where: str, depth: int) -> None:
        code = fn.__code__
        for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell: the variable is not bound yet
                continue
            self.slot(
                value,
                *_cell_access(cell),
                f"closure variable '{name}' of {where}",
                depth,
            )
        # Default values (``lambda h, w=w: ...``, the usual cure for late binding).
        if fn.__defaults__:
            self.slot(
                fn.__defaults__,
                *_attr_access(fn, "__defaults__"),
                f"default arguments of {where}",
                depth,
            )
        if fn.__kwdefaults__:
            self.slot(
                fn.__kwdefaults__,
                *_attr_access(fn, "__kwdefaults__"),
                f"keyword defaults of {where}",
                depth,
            )
        scope = fn.__globals__
        names = _global_names(code)
        for name in sorted(names):
            if name not in scope:
                continue
            value = scope[name]
            if isinstance(value, types.ModuleType):  # ``tables.MASK``: rule 3
                for attr, held in module_tensors(value, names):
                    self.slot(
                        held,
                        *_item_access(vars(value), attr),
                        f"attribute '{attr}' of module '{name}' in {where}",
                        depth,
                    )
                continue
            self.slot(value, *_item_access(scope, name), f"global '{name}' of {where}", depth)

    def module(self, module: torch.nn.Module, where: str, depth: int) -> None:
        for prefix, sub in module.named_modules(remove_duplicate=False):
            path = f"{where}.{prefix}" if prefix else where
            for store in ("_parameters", "_buffers"):
                table = getattr(sub, store)
                # A stateful module's buffers change in every forward (its own
                # guard restores them in the recompute): no version check.
                checked = store == "_parameters" or not is_stateful(sub)
                for key, value in table.items():
                    if isinstance(value, torch.Tensor):
                        access = _item_access(table, key)
                        self.bind(value, *access, f"{path}.{key}", checked, module_state=True,
                                  buffer=store == "_buffers")
            self.attributes(sub, path, depth, modules_done=True)
            cls = type(sub)
            for key, value in vars(cls).items() if self.first_visit(cls) else ():
                if holds_tensor(value):  # a tensor (or a table of them) the class holds: rule 3
                    where_ = f"class attribute '{key}' of {cls.__qualname__}"
                    self.slot(value, *_class_access(cls, key), where_, depth)

    def attributes(self, obj: Any, where: str, depth: int, modules_done: bool = False) -> None:
        for key, value in list(vars(obj).items()):
            if key.startswith("__"):
                continue
            if modules_done and (
                key in MODULE_OWN  # its tables (``_parameters``): walked by `module`
                or isinstance(value, torch.nn.Module)
                # A private attribute neither a tensor nor plain data: a library's
                # callable (``_gradient_checkpointing_func``), or the module's own view
                # of its tables (an RNN's ``_flat_weights``, walked as parameters).
                or (key.startswith("_") and not walks_private(obj, value))
            ):
                continue
            self.slot(
                value,
                *_attr_access(obj, key),
                f"attribute '{key}' of {where}",
                depth,
            )

    def slot(
        self,
        value: Any,
        get: Callable[[], Any],
        set_: Callable[[Any], None],
        where: str,
        depth: int,
    ) -> None:
        if type(value) in _ATOMS:  # most attributes (a module's flags and sizes)
            return
        if isinstance(value, torch.Tensor):
            self.bind(value, get, set_, where)
        elif isinstance(value, _PYTREE_TYPES):
            self.container(value, get, set_, where, depth)
        elif isinstance(value, (types.FunctionType, functools.partial, types.MethodType)):
            self.callable(value, _name(value), depth + 1)
        elif isinstance(value, torch.nn.Module):
            self.callable(value, where, depth + 1)
        else:
            self.value_owner(value, where, depth + 1)

    def container(
        self,
        value: Any,
        get: Callable[[], Any],
        set_: Callable[[Any], None],
        where: str,
        depth: int,
    ) -> None:
        if not self.first_visit(value):
            return
        leaves, treedef = optree.tree_flatten(value, none_is_leaf=True)
        positions = tuple(
            i
            for i, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor) and is_tracked(leaf)
        )
        # Untracked tensor leaves are snapshotted too (rule 4) and seen by `reached`.
        if positions or any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            self.bindings.add(Slot(get, set_, where, positions, leaves, treedef), leaves)
        for leaf in leaves:
            if type(leaf) not in _ATOMS and not isinstance(leaf, torch.Tensor):
                self.value_owner(leaf, f"an element of {where}", depth + 1)

    def bind(
        self,
        value: torch.Tensor,
        get: Callable[[], Any],
        set_: Callable[[Any], None],
        where: str,
        checked: bool = True,
        module_state: bool = False,
        buffer: bool = False,
    ) -> None:
        # An untracked tensor is no input, but its slot still gets the call's
        # tensor back while ``fn`` is recomputed (rule 4).
        tree: Any = value
        leaves: list[Any]
        leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True)
        positions = (0,) if is_tracked(value) else ()
        slot = Slot(
            get, set_, where, positions, leaves, treedef, checked=checked,
            module_state=module_state, buffer=buffer,
        )
        self.bindings.add(slot, leaves)


_Access = tuple[Callable[[], Any], Callable[[Any], None]]


def _cell_access(cell: types.CellType) -> _Access:
    def set_(value: Any) -> None:
        cell.cell_contents = value

    return (lambda: cell.cell_contents), set_


def _item_access(table: dict[str, Any], key: str) -> _Access:
    def set_(value: Any) -> None:
        table[key] = value

    return (lambda: table[key]), set_


def _class_access(cls: type, key: str) -> _Access:
    def set_(value: Any) -> None:
        setattr(cls, key, value)

    return (lambda: vars(cls)[key]), set_


def _attr_access(obj: Any, key: str) -> _Access:
    # object.__setattr__: a module's own __setattr__ would reject a non-Parameter.
    def set_(value: Any) -> None:
        object.__setattr__(obj, key, value)

    return (lambda: getattr(obj, key)), set_


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> frozenset[str]:
    """The names ``code`` (and code nested in it) may look up as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return frozenset(names)
