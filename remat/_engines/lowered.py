"""Regions under ``torch.compile``: lowered to ``torch.utils.checkpoint`` with a selective policy.

NOTE [ Lowering under torch.compile ]
1. When Dynamo traces a region call that `lowers` (``engine="auto"``, no
   ``torch.func`` transform, a policy whose `Policy.lowers` says yes), the call
   becomes ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False,
   context_fn=...)`` whose selective-checkpoint policy is the region's:
   ``SAVE`` is ``MUST_SAVE``, ``RECOMPUTE`` is ``PREFER_RECOMPUTE``. Dynamo
   turns it into a ``tag_activation_checkpoint`` higher-order op, and
   AOTAutograd's partitioner saves what the policy saves and recomputes the
   rest inside the compiled backward graph. ``fullgraph=True`` works.
2. As in the engines (NOTE [ Record and replay ] rule 4), random and in-place
   ops are recomputed whatever the policy says.
3. A policy answers for itself whether it lowers (`Policy.lowers`, False
   unless a policy says otherwise, so a new policy is never lowered by
   mistake). Those that do decide by op and name alone and never ``OFFLOAD``:
   ``everything-saveable``, ``nothing-saveable``, the dots policies,
   `save_these_ops`, the name policies (``save:``, ``save-except:``,
   ``everything-except:``; NOTE [ Names under torch.compile ]) and their sums.
   The others keep the graph break of ``_compile.py`` and run in the eager
   engine: offload (torch 2.13's partitioner does not act on
   ``MUST_CPU_OFFLOAD`` tags; its activation offloading is a testing flag with
   its own choice of values, so a lowered ``OFFLOAD`` would keep or recompute
   the value instead), callables (they may read data or return ``OFFLOAD``)
   and ``save-last``: its last region is the most recent region *call* at run
   time, across graphs and graph breaks, while a lowered region's tags are
   fixed when Dynamo traces its call, before it can know whether another
   region follows in the same graph (or after the next graph break).
4. ``everything-saveable`` runs ``fn`` as is: plain autograd.
5. Nested regions: inside a lowered region every region (lowerable or not)
   runs its function plainly, so the outer policy decides every op: the
   engines' "outer policy wins". The engines' second-level recompute under the
   inner policy is not lowered (it changes memory, not values).
6. ``backend="eager"`` runs the traced checkpoint eagerly, through torch's
   eager selective checkpoint, with ``preserve_rng_state=False``: the
   recompute would draw new dropout masks, silently. Our two modes snapshot
   the random state when the forward starts and restore it around the
   recompute (only when not tracing: traced, the states are fake). Run so,
   they also keep nothing, whatever the policy: torch's eager selective
   checkpoint would refuse a second backward and a kept output written in
   place later. A region that writes a buffer in place still raises there
   (the recompute writes it again). Compiled for real, AOTAutograd replays
   random ops' state in the backward graph itself.
7. With ``activation_memory_budget()`` below 1, torch
   2.13 crashes on ``MUST_SAVE`` for an op with several outputs (SDPA, layer
   norm): those get ``PREFER_SAVE``.
8. Not carried into compiled code: ``determinism_check``, ``debug``,
   ``offload_store``, ``preserve_rng_state=False`` (the state is always
   replayed) and ``remat.is_recomputing()`` (the recompute is compiled code;
   Python does not run again). Module state needs no `StateGuard`:
   AOTAutograd applies a forward's buffer updates once.
9. When Dynamo cannot trace a region's body whole (a graph break inside: a
   ``print``, a side effect, data-dependent Python) it runs the checkpoint
   call eagerly, compiling the body's frames one by one. Torch's checkpoint
   would then recompute compiled frames that update buffers (BatchNorm's
   running statistics twice) and drop names and offload. So the body, run
   eagerly, hands the call to remat's eager engine (the region keeps all its
   guarantees, as a graph break would have given it) and leaves torch's
   checkpoint an empty shell: its forward mode passes ops through, and as no
   tensor is saved under its hooks it never recomputes.
10. View ops are never kept: a kept view keeps its base's storage (a value
    the policy recomputes, under ``everything-except:NAME``) and is a second
    entry for it beside a kept base; recomputed from its base, it is free.
11. A memory budget lowers by following a plan the eager engine made (NOTE
    [ Budget plans ]): the plan is made from an eager call, where saved-tensor
    hooks show exactly which outputs backward reads; a traced call sees fake
    tensors and no saved values, so it is not planned there. `_PlanSelective`
    keeps the eager plans under the region's budget whose ops and argument
    shapes match the traced ops so far (``view`` and ``_unsafe_view`` count as
    one: tracing writes the second as the first) and saves what they all save
    at that position, a kept view's base op in its place (rule 10; the same
    storage, `BudgetPlan.lowered`); a plan that recomputes nothing saves every
    op, as ``everything-saveable`` (the compiled backward may read values the
    eager one does not). No plan yet (the region was compiled before any eager
    call with these shapes), or none matching: a `RematWarning` says so and
    the region keeps nothing from there, which fits every budget; gradients
    are the partitioner's, exact either way. The fix is in the warning: one
    eager call first, then compile.
"""

from __future__ import annotations

import collections
import functools
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy

from .._compat import (
    CachedCheckpointMode,
    CachingCheckpointMode,
    OpOverload,
    activation_memory_budget,
    current_level,
    dispatch_mode_stack,
)
from .._errors import RematWarning
from .._policy.base import Decision, Policy
from .._policy.budget import MemoryBudget
from .._replay.checks import arg_shapes
from .._replay.rng import RngState
from .._replay.traits import draws_random as _draws_random
from .._replay.traits import traits as _traits
from .._state import local
from .budget_plans import BudgetPlan, eager_plans
from .lowered_names import NAME_OP, Producers
from .region import Region

__all__ = ["contexts_for", "lowers", "run_lowered"]


def lowers(region: Region) -> bool:
    """Whether this call of ``region`` is lowered: Dynamo traces it, and it can be
    (NOTE [ Lowering under torch.compile ] rule 1), or it runs inside a lowered region (rule 5)."""
    if not torch.compiler.is_compiling():
        return False
    if local.lowering_depth:
        return True
    return (
        region.selective is not None
        and region.engine == "auto"
        # Not `peek_interpreter_stack()`: Dynamo always sees an interpreter there.
        and current_level() is None
    )


#: How to run a region call in remat's eager engine: ``eager(args, kwargs)``.
Eager = Callable[[tuple[Any, ...], dict[str, Any]], Any]


def run_lowered(
    region: Region,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    eager: Eager,
) -> Any:
    """``fn(*args, **kwargs)`` as a selective checkpoint with ``region``'s policy.

    ``eager`` runs the call in remat's engine instead, should Dynamo give up
    tracing the region whole (NOTE [ Lowering under torch.compile ] rule 9).
    """
    if local.lowering_depth or region.policy.recomputes_nothing:
        return fn(*args, **kwargs)  # NOTE [ Lowering under torch.compile ] rules 4 and 5
    # ``kwargs`` bound here: a keyword such as ``debug`` would go to ``checkpoint``.
    body = functools.partial(_body, fn, eager, kwargs)
    context_fn: Any = region.selective
    local.lowering_depth += 1
    local.lowering_names = region.policy.uses_names
    try:
        return torch_checkpoint.checkpoint(
            body, *args, use_reentrant=False, context_fn=context_fn
        )
    finally:
        local.lowering_depth -= 1
        local.lowering_names = False


def _body(fn: Callable[..., Any], eager: Eager, kwargs: dict[str, Any], *args: Any) -> Any:
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)  # traced into the checkpoint's graph
    # Run by torch's checkpoint in eager mode (rule 9): leave it a shell.
    for mode in reversed(dispatch_mode_stack()):
        if isinstance(mode, _ForwardMode):
            mode.shell = True
            break
    return eager(args, kwargs)


# -- the selective-checkpoint policy and modes --------------------------------


class _SelectivePolicy:
    """A remat policy as the ``policy_fn`` of selective checkpointing."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def verdict(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The policy's verdict on ``op``, or None for an op never kept (rule 2)."""
        if not isinstance(op, OpOverload):
            return None  # a higher-order op
        traits = _traits(op)
        if traits.writes or _draws_random(traits, args, kwargs):
            return None
        if op.is_view:
            return None  # rule 10: recomputed from its base, for nothing
        return self.policy.decide_op(op, args, kwargs)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        verdict = self.verdict(op, args, kwargs)
        if verdict is None or self.policy.decide(verdict, None) is not Decision.SAVE:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return _saved(ctx)


def _saved(ctx: Any) -> CheckpointPolicy:
    several = isinstance(getattr(ctx, "op_output", None), (tuple, list))
    if several and activation_memory_budget() < 1:
        return CheckpointPolicy.PREFER_SAVE  # NOTE [ Lowering under torch.compile ] rule 7
    return CheckpointPolicy.MUST_SAVE


#: Tracing writes ``_unsafe_view`` as ``view`` (rule 11): one op for matching.
_VIEWS = ("aten.view.default", "aten._unsafe_view.default")


class _PlanSelective(_SelectivePolicy):
    """A memory budget's eager plans, followed by position in the traced ops (rule 11).

    One per traced checkpoint call (`fresh`): it counts the ops it is asked about.
    """

    def __init__(self, policy: MemoryBudget, label: str) -> None:
        super().__init__(policy)
        self.budget, self.label = policy, label
        self.index = 0
        self.plans: list[BudgetPlan] | None = None

    def fresh(self) -> _PlanSelective:
        return _PlanSelective(self.budget, self.label)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self.follow(op, args, kwargs) is not Decision.SAVE:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return _saved(ctx)

    def follow(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Decision:
        index, self.index = self.index, self.index + 1
        if self.plans is None:
            self.plans = eager_plans(self.budget)
            if not self.plans:
                self._warn("no eager call has made its plan yet")
        if not self.plans:
            return Decision.RECOMPUTE
        shapes = arg_shapes(args, kwargs)
        matching = [p for p in self.plans if _matches(p, index, op, shapes)]
        if not matching:
            self._warn(
                f"its plan does not match the traced ops at op #{index} ({op} with "
                f"{[tuple(s) for s, _ in shapes]})"
            )
        self.plans = matching
        if not matching or super().verdict(op, args, kwargs) is None:  # rules 2 and 10
            return Decision.RECOMPUTE
        if not any(p.runs for p in matching):  # keeps everything: as everything-saveable
            return Decision.SAVE
        return Decision.SAVE if all(index in p.lowered for p in matching) else Decision.RECOMPUTE

    def _warn(self, what: str) -> None:
        warnings.warn(
            f"remat: {self.label} is compiled under {self.budget!r}, but {what}: the "
            "compiled region keeps nothing from there (within every budget; gradients "
            "are exact). To lower its plan, call it once outside torch.compile with the "
            "same input shapes, then compile (torch._dynamo.reset() if it was compiled "
            "already).",
            RematWarning,
            stacklevel=2,
        )


def _matches(plan: BudgetPlan, index: int, op: Any, shapes: tuple[Any, ...]) -> bool:
    if index >= len(plan.ops) or plan.input_shapes[index] != shapes:
        return False
    return plan.ops[index] is op or (str(plan.ops[index]) in _VIEWS and str(op) in _VIEWS)


class _ForwardMode(CachingCheckpointMode):
    """Torch's forward mode, which snapshots the random state and keeps nothing eagerly.

    Run while tracing, it tags ops with the policy's choices. Run eagerly
    (rule 6) it recomputes every op, whatever the policy: torch's eager
    selective checkpoint hands a kept output to one backward only and refuses
    one written in place later (a residual ``h += x``), where plain autograd
    and remat's engines do neither.
    """

    rng: RngState | None = None
    #: Remat's engine runs the region inside: pass every op through (rule 9).
    shell = False

    def __init__(self, policy_fn: _SelectivePolicy, storage: Any) -> None:
        super().__init__(policy_fn, storage)
        self.selective = policy_fn
        #: The ops behind named values, for a policy that reads names.
        self.producers = Producers(policy_fn.policy) if policy_fn.policy.uses_names else None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if self.shell:
            return func(*args, **(kwargs or {}))
        if func is NAME_OP:
            if self.producers is not None:
                self.producers.name(args[0], args[1])
            return args[0]  # NOTE [ Names under torch.compile ] rule 4
        graph = None if self.producers is None else Producers.graph()
        if graph is None or self.producers is None:
            return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        before = len(graph.nodes)
        out = super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        new = list(itertools.islice(reversed(graph.nodes), len(graph.nodes) - before))
        self.producers.record(out, self.selective.verdict(func, args, kwargs or {}), new)
        return out

    def __enter__(self) -> Any:
        if not torch.compiler.is_compiling():
            self.rng = RngState.capture(())
            self.policy_fn = _recompute_everything
        return super().__enter__()  # type: ignore[no-untyped-call]


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


class _RecomputeMode(CachedCheckpointMode):
    """Torch's recompute mode, run with the forward's random state (rule 6)."""

    def __init__(self, forward: _ForwardMode, storage: Any) -> None:
        super().__init__(None, storage)
        self.forward = forward
        self._restored: Any = None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is NAME_OP:
            return args[0]  # as in the forward: NOTE [ Names under torch.compile ] rule 4
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]

    def __enter__(self) -> Any:
        if self.forward.rng is not None:
            self._restored = self.forward.rng.restored()
            self._restored.__enter__()
        return super().__enter__()  # type: ignore[no-untyped-call]

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            restored, self._restored = self._restored, None
            if restored is not None:
                restored.__exit__(None, None, None)


def contexts_for(
    policy: Policy, label: str = "a region"
) -> Callable[[], tuple[Any, Any]] | None:
    """The ``context_fn`` that lowers ``policy``, or None when it does not lower.

    Made with the region, before Dynamo traces a call (it refuses a
    ``context_fn`` made while tracing), as a ``functools.partial`` of a module
    function (it refuses a callable object; a local function would not pickle).
    ``label`` names the region in warnings.
    """
    if not policy.lowers:
        return None
    if isinstance(policy, MemoryBudget):
        return functools.partial(_modes, _PlanSelective(policy, label))
    return functools.partial(_modes, _SelectivePolicy(policy))


def _modes(policy_fn: _SelectivePolicy) -> tuple[_ForwardMode, _RecomputeMode]:
    """A fresh pair of modes for one checkpoint call, sharing their storage."""
    if isinstance(policy_fn, _PlanSelective):
        policy_fn = policy_fn.fresh()  # it counts the call's ops
    storage: dict[Any, dict[int, Any]] = collections.defaultdict(dict)
    forward = _ForwardMode(policy_fn, storage)
    return forward, _RecomputeMode(forward, storage)
