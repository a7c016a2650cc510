"""Tensors a region reads through a binding, and whether its recompute may read them again.

NOTE [ Bindings the recompute reads ]
1. The eager engine's recompute runs ``fn`` again, so it reads every closure
   cell, global, dict or list entry and object attribute again. A tensor bound
   there may have been rebound (a new tensor assigned) or written in place since
   the forward read it. The recompute would then differentiate a forward that
   never ran, and nothing it saves shows it when the tensor reaches the region's
   values only through ops that save nothing of it (an added bias, a mask, a
   running statistic). (The torch.func engine passes such tensors as inputs of
   its Function: NOTE [ Closed-over tensors ].)
2. So when a forward starts, the engine notes each tensor on the walk of what
   ``fn`` reaches (the generator walk of ``_replay/generators.py``, kept per
   function: `Walk.tensor_steps`) and its version. Module parameters
   and buffers are not on that walk: the module state guard gives the recompute
   what the forward read (NOTE [ State the forward changes ]), and a tensor a
   slot of theirs held (``functional_call`` swapping one in) is left to it. A
   function that reaches no tensor and no submodule this way pays nothing; a
   module pays one replayed read per submodule and per call (rule 5).
3. When the recompute starts, each binding is read again. One that gives the
   same tensor at the same version is fine: the usual case, and then nothing
   else runs. A tensor now bound that is another one, or the same one written
   since, is *moved*.
4. While a recompute with moved tensors runs, a `TorchFunctionMode` raises
   `SavedInputMutatedError` at the first op that reads one, naming the binding,
   the region and the fixes. A moved tensor the recompute does not read (an
   attribute the region stores an output in, a hook's list) raises nothing. A
   region that rebinds a tensor during its own forward and reads the new one
   in its recompute raises too: the recompute cannot tell which one the
   forward read where. So does one read by an op whose output the policy kept
   (``dots-saveable`` keeping the matmul that reads it), which a replay would
   not rerun: the check sees torch calls, not what the replay does with them.
5. Submodules likewise: a module on the walk (a wrapped module's submodules, a
   bound method's module's) that is another object when the recompute starts
   (model surgery, a swapped head or adapter) would run in the recompute in place
   of the one the forward ran, so the recompute raises before it starts (also
   where the policy kept all that module made, which a replay would not rerun:
   the cheap check cannot tell).
6. And their modes: a module on the walk (the region's own included) whose
   ``training`` flag differs when the recompute starts (``model.eval()``
   between the forward and the backward; a forward in eval mode, then
   ``model.train()`` and a second forward, then one backward) would recompute
   another function (dropout off, batch statistics replaced by running ones).
   So the recompute runs with each such module's flag set back to the one its
   forward ran with, and put back after (`modes_restored`; the torch.func
   engine does the same): the gradient of the forward that ran, as plain
   autograd gives. One tuple comparison when nothing switched.
7. Not checked here: what the walk does not reach (deeper than its depth, wider
   than its width, a ``__slots__`` object, a tensor a call returns, the
   attributes of an argument object). A saved one is still checked by
   `FrameState.check_rebound` and `check_unbound`.
8. A binding the region *itself* rebinds during its forward (a rotary cache grown
   when a longer sequence arrives: ``self.cos_cached = ...`` or
   ``register_buffer`` again, and a Python int ``maxlen`` with it) is read by
   the recompute as the forward left it, where the forward did not read the
   tensor it held before: the recompute then reads the tensor the forward read
   after rebinding, and the Python state the forward changed (``maxlen``) says
   not to rebuild it. What the forward's ops read is noted while it runs
   (`ForwardReads` in ``_capture/reads.py``, a `TorchFunctionMode` noting the
   id of every tensor an op gets, its ``shape`` and ``len`` included), only for
   a region whose walk reaches a tensor or a module holding buffers: the tensor
   bound at the start is alive throughout, so its id in the set means it was
   read. At the forward's end each binding is read again (`settle`): one
   rebound to a tensor and whose start tensor no op read is noted as it is
   then, and the module state guard does the same for its buffer slots
   (`settle_pins`). A forward that read the old tensor and then rebound it (a
   running average ``self.state = self.state * 0.9 + m``) keeps rule 4: its
   recompute would read the new state where the forward read the old one, and
   raises (a module buffer is the fix: the guard gives the recompute the start
   tensor, and the recompute rebinds it as the forward did). Rebinding after
   the forward is rule 4 as before. Not told apart: a forward that rebinds a
   binding twice, reading the first new tensor in between, and whose Python
   state makes the recompute skip the first rebinding (like a Python number
   the region changes, a documented limit).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..._capture.module_state import StateGuard
from ..._capture.reads import ForwardReads
from ..._errors import SavedInputMutatedError
from ..._pytree import tensor_leaves
from ..._replay.generators import Walk

__all__ = [
    "BoundAtForward",
    "forward_reads",
    "check_replaced",
    "modes_of",
    "modes_restored",
    "refusing_moved",
    "replaced_submodule_error",
]


class BoundAtForward:
    """The tensors a region's function reached through bindings when its forward began."""

    __slots__ = ("fn", "modes", "modules", "tensors", "versions", "walk")

    def __init__(self, fn: Any, walk: Walk) -> None:
        self.fn = fn
        self.walk = walk
        # Held, not weakly referenced: a weak reference would stop the escape
        # machinery's `swap_tensors`, and an id alone can be reused. What is still
        # bound costs nothing; a tensor rebound since stays alive until the recompute.
        self.tensors = walk.read_tensors(fn)
        self.versions = [
            t._version if isinstance(t, torch.Tensor) and not t.is_inference() else -1
            for t in self.tensors
        ]
        self.modules = walk.read_steps(fn, walk.module_steps)  # alive anyway (rule 5)
        self.modes = modes_of(self.modules)

    @classmethod
    def capture(cls, fn: Any, walk: Walk) -> BoundAtForward | None:
        """Note what ``walk`` (`walk_of(fn)`) reaches now; None when no tensor (rule 2)."""
        return cls(fn, walk) if walk.tensor_steps or walk.module_steps else None

    def settle(self, reads: set[int]) -> None:
        """At the forward's end: a binding the forward rebound to a tensor without
        reading the one it held at the start is checked against the new one (rule 8)."""
        now_bound = self.walk.read_tensors(self.fn)
        for i, (then, now) in enumerate(zip(self.tensors, now_bound, strict=True)):
            if now is then or not isinstance(now, torch.Tensor) or id(then) in reads:
                continue
            self.tensors[i] = now
            self.versions[i] = now._version if not now.is_inference() else -1

    def check_modules(self, label: str) -> None:
        """Raise if a submodule the forward reached was replaced since (rule 5)."""
        check_replaced(self.walk, self.fn, self.modules, label)

    def moved(self, guarded: set[int]) -> dict[int, tuple[torch.Tensor, int, str]]:
        """Each tensor bound now that the forward did not read there, by id:
        (it, its step in the walk, what happened). ``guarded``: ids of tensors the
        module state guard gives the recompute as the forward read them."""
        out: dict[int, tuple[torch.Tensor, int, str]] = {}
        now_bound = self.walk.read_tensors(self.fn)
        steps = self.walk.tensor_steps
        for step, then, version, now in zip(
            steps, self.tensors, self.versions, now_bound, strict=True
        ):
            if not isinstance(now, torch.Tensor):
                continue  # unbound, or no tensor now: what reads it differs visibly
            if id(now) in guarded or id(then) in guarded:
                continue  # module state (a tensor functional_call swapped into a module)
            if now.is_meta:
                continue  # a dead op's stand-in, stored by another recompute: reading it
                # raises, naming who stored it (NOTE [ Stand-ins in Python state ])
            if then is not now:
                out[id(now)] = (now, step, "is another tensor than the forward read there")
            elif version != -1 and now._version != version:
                out[id(now)] = (now, step, "was written in place since the forward read "
                                           f"it (version {version}, now {now._version})")
        return out


def modes_of(modules: list[Any]) -> tuple[bool, ...]:
    """The ``training`` flag of each module ``Walk.read_steps`` gave (rule 6)."""
    return tuple(bool(getattr(m, "training", False)) for m in modules)


@contextmanager
def modes_restored(modules: list[Any], modes: tuple[bool, ...]) -> Iterator[None]:
    """Run a recompute with each of ``modules`` in the mode ``modes`` its forward
    ran in, and put back the mode it has now after (rule 6)."""
    now = modes_of(modules)
    if now == modes:  # the usual case
        yield
        return
    switched = [(m, then, mode) for m, then, mode in zip(modules, modes, now, strict=True)
                if then != mode]
    for module, then, _ in switched:
        module.training = then  # this module only: each submodule has its own entry
    try:
        yield
    finally:
        for module, _, mode in switched:
            module.training = mode


def check_replaced(walk: Walk, fn: Any, modules: list[Any], label: str) -> None:
    """Raise `replaced_submodule_error` if a module the walk gave as ``modules`` at
    the forward is another object now (rule 5; both engines' recompute)."""
    now = walk.read_steps(fn, walk.module_steps)
    for step, then, module in zip(walk.module_steps, modules, now, strict=True):
        if module is not then:
            raise replaced_submodule_error(walk.describe(fn, step), label, then, module)


def replaced_submodule_error(
    where: str, label: str, then: Any, now: Any
) -> SavedInputMutatedError:
    """A submodule at ``where`` on the walk was ``then`` in the forward, ``now`` is another
    (rule 5; the torch.func engine's recompute says the same, ``functional/submodules.py``)."""
    return SavedInputMutatedError(
        f"remat: submodule {where.lstrip('.')} of {label} was replaced after its "
        f"forward pass ran the {type(then).__name__} there (it holds a "
        f"{type(now).__name__} now), so the recompute would run another "
        "module and the gradient would be that of a forward that did not run. "
        "Replace it after backward, or use policy='everything-saveable' for "
        "this region."
    )


def forward_reads(bound: BoundAtForward | None) -> ForwardReads | None:
    """The mode noting what a forward reads, where a binding it rebinds may matter:
    its walk reaches a tensor, or a module holding buffers (rule 8)."""
    if bound is None or not (bound.tensors or any(m._buffers for m in bound.modules)):
        return None
    return ForwardReads()


class _RefuseMoved(TorchFunctionMode):
    """Raise at the first op of the recompute that reads a moved tensor (rule 4)."""

    def __init__(
        self, bound: BoundAtForward, label: str, moved: dict[int, tuple[torch.Tensor, int, str]]
    ) -> None:
        super().__init__()
        self.bound = bound
        self.label = label
        self.moved = moved

    def __torch_function__(
        self, func: Any, types_: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        for leaf in tensor_leaves((args, kwargs)):
            if id(leaf) in self.moved:
                raise self.error(self.moved[id(leaf)])
        return func(*args, **kwargs)

    def error(self, entry: tuple[torch.Tensor, int, str]) -> SavedInputMutatedError:
        t, step, what = entry
        where = self.bound.walk.describe(self.bound.fn, step)
        return SavedInputMutatedError(
            f"remat: the recompute of {self.label} reads {where} (a tensor of shape "
            f"{tuple(t.shape)}), which {what}, so the gradient would be that of a "
            "forward that did not run. Pass the tensor to the region as an argument, "
            "keep it in a module buffer (the recompute then sees what the forward "
            "read), rebind or modify it only after backward, or use "
            "policy='everything-saveable' for this region."
        )


@contextmanager
def refusing_moved(
    bound: BoundAtForward | None, label: str, guard: StateGuard
) -> Iterator[None]:
    """Run a recompute that raises if it reads a moved tensor; costs nothing if none moved."""
    if bound is None:
        yield
        return
    if bound.modules:
        bound.check_modules(label)
    moved = bound.moved(guard.guarded_ids()) if bound.tensors else {}
    with modes_restored(bound.modules, bound.modes):
        if not moved:
            yield
            return
        with _RefuseMoved(bound, label, moved):
            yield
