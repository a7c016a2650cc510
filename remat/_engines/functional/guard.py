"""The guard against tensors the Function was not given.

NOTE [ The functional engine ] rule 2 (in ``__init__.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import optree
import torch

from ..._capture.closure import Bindings
from ..._compat import (
    functorch_level,
    interpreters,
    is_functorch_wrapped,
    unwrap_once,
)
from ..._compile import UncompiledMode
from ..._errors import RematError
from ..._replay.checks import OpTrace
from ..._state import local
from ..autograd_inside import differentiated_by, feeds, outside_grad_error
from ..escapes import EscapeWatch
from ..region import Region
from ..torch_func_refusal import backward_inside, is_backward_call
from .levels import _wrapped


class GuardedCall(Protocol):
    """One call of a region as the guard sees it (`_Call` in ``call.py``)."""

    region: Region
    inputs: tuple[torch.Tensor, ...]
    originals: tuple[torch.Tensor, ...]
    original_ids: set[int]
    outer_levels: set[int]
    tensor_count: int
    bindings: Bindings
    trace: OpTrace
    escapes: EscapeWatch


def unsubstituted_error(call: GuardedCall) -> RematError:
    """A transform inside ``fn`` wrapped a closed-over tensor itself (functorch's assert).

    Inside the forward the outer levels are lowered, so a transform ``fn``
    runs gets the number of one of them; wrapping a tensor of that outer
    level there fails inside functorch before any op sees it.
    """
    found = ", ".join(call.bindings.names) or "a tensor it closes over"
    return RematError(
        f"remat: {call.region.label} hands a tensor it reached without receiving it "
        f"straight to a torch.func transform run inside the region (one of: {found}); "
        "remat substitutes such tensors op by op, and a transform's own wrapping is no "
        "op. Pass that tensor itself as an argument of the rematerialized function."
    )


class _HiddenInputGuard:
    """Raise `RematError` when ``fn`` uses a tracked tensor that is not an input.

    Levels are numbered by depth, so inside the forward (run with the outer
    levels lowered) a level pushed there (the recorded forward's ``vjp``, a
    transform ``fn`` runs itself) gets the number of an outer one: a hidden
    wrapper of the outer level 1 looks like one of the inner level 1, and the
    inner level would treat it as its own and drop its gradient. So a wrapper
    at the number of an outer level passes only if the guard knows it: an
    input, a wrapper the engine made of an input, the output of an op run under
    the guard, or a wrapper (a transform inside ``fn``) of one of those.
    """

    def __init__(self, call: GuardedCall, inputs: Sequence[torch.Tensor]) -> None:
        self.call = call
        self.known = {id(t) for t in inputs}
        self.inputs = list(inputs)
        #: Ids of tensors aten ops made inside the forward (filled by `_Births`).
        self.born: set[int] = set()
        self.live = {i.level() for i in interpreters()}

    def know(self, tensors: Sequence[Any]) -> None:
        self.known.update(id(t) for t in tensors if isinstance(t, torch.Tensor))

    def run(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any]
    ) -> Any:
        """Run one torch call of the forward, its tensors already substituted, checking it.

        ``leaves`` are those of ``(args, kwargs)``. Besides the hidden-input check,
        the call is offered to the recompute signature (NOTE [ Recompute signatures ]),
        its ``autograd.grad`` targets are checked, and its outputs are noted for
        escapes (NOTE [ Escaped tensors ]).
        """
        recording = self.call.trace.offer(func, args, kwargs)
        # remat's own reads (the state guard's versions of the slots a module reads,
        # which under the vmap rule hold the caller's batched tensors) are no use by ``fn``.
        if not local.internal_depth:
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor) and id(leaf) not in self.known:
                    self.check(leaf, func)
        if is_backward_call(func):
            raise backward_inside(self.call.region.label, bool(self.call.outer_levels))
        targets = differentiated_by(func, args, kwargs)
        for t in targets:
            self.check_grad_target(t)
        try:
            out = func(*args, **kwargs)
        except RuntimeError as error:
            if targets and "not have been used in the graph" in str(error):
                self.check_grad_result(targets, (None,) * len(targets))
            if targets and "does not require grad and does not have a grad_fn" in str(error):
                raise self.no_autograd_inside(error) from error
            raise
        if targets and isinstance(out, tuple):
            self.check_grad_result(targets, out)
        out_leaves: list[Any] = optree.tree_leaves(out, none_is_leaf=True)
        self.know(out_leaves)
        if recording is not None:
            recording.made(out_leaves)
        self.call.escapes.note(func, args, kwargs, leaves, out_leaves)
        return out

    def no_autograd_inside(self, error: RuntimeError) -> RematError:
        region = self.call.region
        return RematError(
            f"remat: {region.label} calls torch.autograd.grad on a value that does not "
            f"require grad ({error}). Under the torch.func engine, policy "
            f"{region.policy!r} runs the function's forward as an autograd.Function "
            "forward, without autograd, so nothing inside it can be differentiated "
            "there. Use policy='everything-saveable' for this region (it then runs as "
            "plain autograd)."
        )

    def _outer(self, t: torch.Tensor) -> int | None:
        """The index of the Function input that ``t`` is (or wraps), if any."""
        while True:
            for i, given in enumerate(self.inputs):
                if t is given:
                    return i
            if not is_functorch_wrapped(t):
                return None
            t = unwrap_once(t)

    def check_grad_target(self, t: torch.Tensor) -> None:
        """``torch.autograd.grad`` with respect to an input that feeds another input
        outside the region: that path is not in the Function (``_engines/autograd_inside.py``)."""
        i = self._outer(t)
        if i is None:
            return
        outer = self.call.inputs  # as given to the Function: their graph is walkable
        others = [x for j, x in enumerate(outer) if j != i]
        if feeds(outer[i], others):
            raise outside_grad_error(self.call.region.label, t)

    def check_grad_result(self, targets: list[torch.Tensor], out: tuple[Any, ...]) -> None:
        # Where the outer graph cannot be walked (a vmap level hides it), a None
        # gradient (allow_unused) for a wrapped input may be such a missing path. Loud.
        for t, g in zip(targets, out, strict=False):
            i = self._outer(t)
            if g is None and i is not None and _wrapped(self.call.inputs[i]):
                raise outside_grad_error(self.call.region.label, t)

    def check(self, t: torch.Tensor, func: Any) -> None:
        self._check_substituted(t, func)
        if is_functorch_wrapped(t):
            level = functorch_level(t)
            if level in self.call.outer_levels:
                if self._wraps_known(t):
                    self.known.add(id(t))
                    return
            else:
                if level not in self.live:  # a level pushed inside the forward
                    self.live = {i.level() for i in interpreters()}
                if level in self.live:
                    return
        elif not t.requires_grad or id(t) in self.born:
            # (Born here: an inner region's output, recorded by eager autograd in its
            # ``vjp``, requires grad; a hidden input existed before the forward.)
            return
        name = getattr(func, "__name__", str(func))
        raise RematError(
            f"remat: {self.call.region.label} uses a tensor that is neither an argument "
            f"nor found among the tensors it closes over (shape {tuple(t.shape)}, dtype "
            f"{t.dtype}, used by {name}); under torch.func its gradient would silently "
            "be zero. remat finds tensors in the arguments (pytrees, dataclasses, dict "
            "and list subclasses, and the attributes of objects passed in), closure "
            "variables, default arguments, module parameters, attributes of objects "
            "the function reaches, and globals; not in __slots__ or in what a call "
            "returns. Pass the tensor itself as an argument, or register the type "
            "that holds it as a pytree: optree.register_pytree_node(cls, flatten_func, "
            "unflatten_func, namespace='remat')."
        )

    def _check_substituted(self, t: torch.Tensor, func: Any) -> None:
        """Raise if a tensor ``fn`` reached got to an op as itself, not as the Function's view.

        The substitution sees the tensors in an op's pytree arguments; one
        reached some other way (a transform ``fn`` runs on a closed-over tensor,
        ``torch.func.grad(g)(self.w)``, wraps it where no op sees it) would be
        differentiated outside the region.
        """
        inner = t
        while True:
            if id(inner) in self.known:  # an input itself (the forward got it unwrapped)
                return
            if id(inner) in self.call.original_ids:
                break
            if not is_functorch_wrapped(inner):
                return
            inner = unwrap_once(inner)
        index = next(i for i, o in enumerate(self.call.originals) if o is inner)
        count = self.call.tensor_count
        where = (
            f"argument tensor #{index}" if index < count
            else self.call.bindings.names[index - count]
        )
        name = getattr(func, "__name__", str(func))
        raise RematError(
            f"remat: {self.call.region.label} hands {where} to {name} in a way remat "
            "cannot substitute (inside a container it does not flatten, or straight into "
            "a torch.func transform run inside the region), so under torch.func it would "
            "be differentiated outside the region. Pass that tensor itself as an argument "
            "of the rematerialized function."
        )

    def _wraps_known(self, t: torch.Tensor) -> bool:
        while is_functorch_wrapped(t):
            t = unwrap_once(t)
            if id(t) in self.known or id(t) in self.born:
                return True
        return False


class _Births(UncompiledMode):
    """Note every tensor an aten op makes inside the forward (in the guard's ``born``).

    Transforms that ``fn`` runs itself (or the engine's ``vjp``) return tensors
    that no Python-level op produced (gradients from the autograd engine,
    outputs unwrapped on exit); their values were still made by aten ops inside
    the forward, unlike a hidden wrapper's, which existed before it.
    """

    def __init__(self, guard: _HiddenInputGuard) -> None:
        super().__init__()
        self.born = guard.born

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One op (outside torch.compile, not through ``torch.compiler.disable``)."""
        out = func(*args, **kwargs)
        leaves: list[Any] = optree.tree_leaves(out, none_is_leaf=False)
        self.born.update(id(t) for t in leaves if isinstance(t, torch.Tensor))
        return out
