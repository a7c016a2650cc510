"""Budget plans: how the engines apply a `MemoryBudget` (one plan per region and signature).

NOTE [ Budget plans ]
1. When a region's policy is a memory budget, each call's op log gets a
   policy of its own (`log_policy`), looked up by the call's *signature*: the
   engine, the shapes, dtypes, devices and ``requires_grad`` of the tensor
   inputs, a module's parameters' ``requires_grad`` (freezing changes what
   autograd saves) and the autocast state.
2. First call with a signature: `Planning` keeps every output (the forward
   runs as everything-saveable would). When the forward ends the engine calls
   `settle`: the log and the values autograd saved become a `Program`, the
   planner chooses the kept set (``_policy/planner.py``), the plan is cached, and the
   records it drops are released at once (the eager engine empties their
   holders). So the first call with a new signature peaks like no remat in its
   forward; what it holds for backward, like every later call, is the plan's.
3. Later calls: `Planned` decides by position in the op sequence from the
   plan. A call whose ops differ from the plan's (data-dependent control flow
   with the same signature) is settled as keeping nothing (within every
   budget; gradients as always exact) and its signature planned again next
   call.
4. The eager engine's plan reads which outputs autograd saved (its holders);
   the torch.func engine has no saved-tensor hooks under a transform and
   replays every kept op, so its plan counts every op output as read
   (NOTE [ The budget planner ] rule 2), and fractions there are of the bytes
   of every op output of the region.
5. Regions with regions inside (nested `remat` calls) are planned as keeping
   nothing: the inner regions' recompute rules are not in the model.
6. Never more than no remat. The eager engine holds a region's inputs for its
   recompute; autograd alone would free those it saves nothing of (Llama's
   ``position_ids``). So a call whose plan recomputes nothing runs as plain
   autograd (`plain_call`: what no remat holds, exactly), and a plan that
   recomputes keeps at most ``full - those inputs' bytes`` (its budget is cut
   so): the region then holds no more than no remat does. (Where those inputs
   alone outweigh every activation, no plan short of keeping everything can
   promise that; the budget wins.)
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from .._compat import physical, storage_address
from .._policy import ops as _ops
from .._policy.base import Decision, Policy
from .._policy.budget import MemoryBudget
from .._policy.planner import Outcome, Program, evaluate, solve
from .._pytree import tensor_leaves
from .._replay.records import OpLog
from .budget_program import Saved, build_program
from .region import Region

__all__ = [
    "BudgetPlan",
    "Planned",
    "Planning",
    "eager_plans",
    "log_policy",
    "plain_call",
    "plan_key",
    "plans_of",
    "settle",
]

@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """What a memory budget keeps for one region and input signature.

    Attributes:
        policy (MemoryBudget): the budget.
        budget_bytes (int): the budget in bytes.
        full_bytes (int): what the region holds keeping everything (the fraction's base).
        held_bytes (int): what the plan holds for backward (predicted; exact on CPU).
        cost (int): the recompute cost of the plan (``_policy/op_cost.py``: FLOPs + bytes moved).
        full_cost (int): the recompute cost keeping nothing (``nothing-saveable``).
        solver (str): which solver chose (exact MILP, rounded LP, or a shortcut).
        ops (tuple of str): the region's ops in order.
        op_bytes (tuple of int): bytes each op's outputs would hold if kept.
        kept (frozenset of int): the ops whose outputs are kept.
        runs (frozenset of int): the ops the recompute runs again.
    """

    policy: MemoryBudget
    engine: str
    budget_bytes: int
    full_bytes: int
    held_bytes: int
    cost: int
    full_cost: int
    solver: str
    ops: tuple[Any, ...]
    op_bytes: tuple[int, ...]
    kept: frozenset[int]
    runs: frozenset[int]
    #: (shape, dtype) of each op's tensor arguments, for matching a traced region.
    input_shapes: tuple[Any, ...] = ()
    #: What a compiled graph saves for `kept`: a kept view's base op instead (a
    #: lowered region never saves views; NOTE [ Lowering under torch.compile ] rule 11).
    lowered: frozenset[int] = frozenset()

    def decision(self, index: int) -> Decision:
        """The decision for the outputs of op ``index``."""
        return Decision.SAVE if index in self.kept else Decision.RECOMPUTE

    def __str__(self) -> str:
        lines = [f"{'#':>4}  {'op':<40} {'bytes':>10}  decision"]
        for i, op in enumerate(self.ops):
            what = "SAVE" if i in self.kept else ("recompute" if i in self.runs else "-")
            lines.append(f"{i:>4}  {op!s:<40} {self.op_bytes[i]:>10}  {what}")
        lines.append(
            f"{self.policy!r} ({self.engine} engine, {self.solver}): budget "
            f"{self.budget_bytes} B of {self.full_bytes} B; holds {self.held_bytes} B; "
            f"recompute cost {self.cost} of {self.full_cost} (keeping nothing)"
        )
        return "\n".join(lines)


#: Plans by the function a region runs, then by budget, then by signature (NOTE rule 1).
_PLANS: weakref.WeakKeyDictionary[Any, dict[Policy, dict[Hashable, BudgetPlan]]] = (
    weakref.WeakKeyDictionary()
)
#: For functions that take no weak reference: by region.
_BY_REGION: weakref.WeakKeyDictionary[Region, dict[Policy, dict[Hashable, BudgetPlan]]] = (
    weakref.WeakKeyDictionary()
)


def _home(region: Region) -> Any:
    """What a region's plans belong to: its module or function, stable across calls.

    A wrapped module's region is remade for every call (``_modules._Forward``
    holds the module), so the plans live on the module itself.
    """
    module = getattr(region.fn, "module", None)
    return module if isinstance(module, torch.nn.Module) else region.fn


def plans_of(region: Region) -> dict[Hashable, BudgetPlan]:
    """The plans made so far for ``region``'s function under its budget, by signature."""
    home = _home(region)
    try:
        table = _PLANS.setdefault(home, {})
    except TypeError:  # not weakly referenceable
        table = _BY_REGION.setdefault(region, {})
    return table.setdefault(region.policy, {})


class Planning(Policy):
    """A first call's log policy: keep everything until `settle` plans (NOTE rule 2)."""

    uses_ops = True
    plans_from_log = True

    def __init__(self, budget: MemoryBudget, region: Region, key: Hashable, engine: str) -> None:
        self.budget, self.region, self.key, self.engine = budget, region, key, engine

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.SAVE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.SAVE

    def __repr__(self) -> str:
        return f"{self.budget!r} (planning)"


class Planned(Policy):
    """A later call's log policy: the plan's decision by op position (NOTE rule 3)."""

    uses_ops = True

    def __init__(self, plan: BudgetPlan, region: Region, key: Hashable) -> None:
        self.plan, self.region, self.key = plan, region, key
        self.diverged = False

    def decide_record(
        self, index: int, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Hashable:
        ops = self.plan.ops
        if index >= len(ops) or ops[index] != op:
            self.diverged = True
        if self.diverged:
            return Decision.RECOMPUTE
        return self.plan.decision(index)

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.RECOMPUTE  # only `decide_record` knows the position

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        assert isinstance(verdict, Decision), "this is a bug in remat, please report it"
        return verdict

    def __repr__(self) -> str:
        return repr(self.plan.policy)


def plan_key(region: Region, inputs: Sequence[torch.Tensor], engine: str) -> Hashable:
    tensors = tuple(
        (tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for t in inputs
    )
    home = _home(region)
    frozen = (
        tuple(p.requires_grad for p in home.parameters())
        if isinstance(home, torch.nn.Module)
        else ()
    )
    autocast = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )
    return (engine, tensors, frozen, autocast)


def log_policy(region: Region, inputs: Sequence[torch.Tensor], engine: str) -> Policy:
    """The policy a call's op log asks: the region's, or its budget plan's (NOTE rule 1)."""
    policy = region.policy
    if not isinstance(policy, MemoryBudget):
        return policy
    key = plan_key(region, inputs, engine)
    plan = plans_of(region).get(key)
    if plan is None:
        return Planning(policy, region, key, engine)
    return Planned(plan, region, key)


def settle(
    log: OpLog,
    saved: Sequence[Saved] | None,
    inputs: Sequence[torch.Tensor],
    outside: Sequence[torch.Tensor] = (),
) -> frozenset[int]:
    """End of a forward: plan a first call, check a later one; return the records dropped.

    ``saved``: the values autograd saved (the eager engine), or None (the
    torch.func engine: every output counts as read, NOTE rule 4). ``inputs``:
    the region's tensor inputs; ``outside``: other tensors autograd saved that
    the region did not make (closed-over tensors, parameters, inputs).
    """
    policy = log.policy
    if isinstance(policy, Planned):
        if not policy.diverged and len(log.records) == len(policy.plan.ops):
            return frozenset()
        plans_of(policy.region).pop(policy.key, None)  # plan again next call
        return _apply(log, frozenset())
    if not isinstance(policy, Planning):
        return frozenset()
    program, op_bytes = build_program(log, saved, [*inputs, *outside])
    full = program.full_bytes()
    budget = policy.budget.budget_bytes(full)
    if budget < full and saved is not None:  # NOTE rule 6
        budget = max(0, min(budget, full - _frame_only_bytes(log, saved, inputs, outside)))
    if log.regions:  # NOTE rule 5
        outcome = dataclasses.replace(evaluate(program, ()), solver="nested regions: keep nothing")
    else:
        outcome = solve(program, budget)
    plan = _plan(policy, log, program, outcome, budget, full, op_bytes)
    plans_of(policy.region)[policy.key] = plan
    return _apply(log, plan.kept)


def _frame_only_bytes(
    log: OpLog,
    saved: Sequence[Saved],
    inputs: Sequence[torch.Tensor],
    outside: Sequence[torch.Tensor],
) -> int:
    """Bytes of the inputs only the engine holds (autograd saves nothing of them; NOTE rule 6).

    Autograd may save an input itself (``outside``) or a view the region made of it
    (``cos.unsqueeze(1)`` in rotary embeddings): both keep its storage.
    """
    held = {storage_address(physical(t)) for t in outside}
    for index, position, _ in saved:
        kept = log.records[index].kept_at(position)
        if kept is not None:
            held.add(storage_address(physical(kept)))
    out: dict[int, int] = {}
    for t in inputs:
        address = storage_address(physical(t))
        if address and address not in held:
            out[address] = physical(t).untyped_storage().nbytes()
    return sum(out.values())


def plain_call(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this eager call's plan recomputes nothing: it runs as plain autograd (rule 6)."""
    if not isinstance(region.policy, MemoryBudget):
        return False
    plan = plans_of(region).get(plan_key(region, tensor_leaves((args, kwargs)), "eager"))
    return plan is not None and not plan.runs


def _plan(
    policy: Planning,
    log: OpLog,
    program: Program,
    outcome: Outcome,
    budget: int,
    full: int,
    op_bytes: tuple[int, ...],
) -> BudgetPlan:
    return BudgetPlan(
        policy=policy.budget,
        engine=policy.engine,
        budget_bytes=budget,
        full_bytes=full,
        held_bytes=outcome.held_bytes,
        cost=outcome.cost,
        full_cost=evaluate(program, ()).cost,
        solver=outcome.solver,
        ops=tuple(rec.op for rec in log.records),
        op_bytes=op_bytes,
        kept=outcome.kept,
        runs=outcome.runs,
        input_shapes=tuple(rec.input_shapes for rec in log.records),
        lowered=_lowered(log, program, outcome.kept),
    )


def _lowered(log: OpLog, program: Program, kept: frozenset[int]) -> frozenset[int]:
    """`BudgetPlan.lowered`: each kept view stands for the op that made its storage."""
    out = set()
    for index in kept:
        while _view_like(log.records[index].op) and program.producers[index]:
            index = program.producers[index][0]
        if not _view_like(log.records[index].op):
            out.add(index)  # (a view of an input holds nothing of the region's)
    return frozenset(out)


def _view_like(op: Any) -> bool:
    # Tracing writes ``_unsafe_view`` (a copy-free reshape) as ``view``.
    return _ops.is_view(op) or str(op) == "aten._unsafe_view.default"


def eager_plans(policy: MemoryBudget) -> list[BudgetPlan]:
    """Every eager plan made so far under ``policy`` (or an equal budget), for lowering."""
    tables = [*list(_PLANS.values()), *list(_BY_REGION.values())]
    return [p for t in tables for p in t.get(policy, {}).values() if p.engine == "eager"]


def _apply(log: OpLog, kept: frozenset[int]) -> frozenset[int]:
    """Release every kept record the plan does not keep; return their indices."""
    dropped = []
    for rec in log.records:
        if rec.index in kept or not rec.holds_outputs():
            continue
        rec.plan_recompute()
        dropped.append(rec.index)
    return frozenset(dropped)
