"""The memory-budget planner: which op outputs a region keeps so that it fits a budget.

NOTE [ The budget planner ]
1. The input is a `Program`, made from one recorded forward (``_engines/budget_plans.py``):
   per op its recompute cost (``_op_cost.py``), whether keeping it can help
   (random, in-place and data-reading ops are never kept; neither is an output
   written in place after it was made), the ops that produced its inputs, and
   the storages its outputs live in with their bytes; and the *needed* values:
   the outputs backward reads (autograd saved them), each with its storage and
   the holder's clock (ops recorded before it was saved).
2. The model is the eager engine's, exactly (NOTE [ Record and replay ] rule 5):
   a needed value is held if its op is kept, else its op runs in the
   recompute; an op that runs needs each producer kept or run; a kept op read
   by a running op is held whole (the replay returns all its outputs); a kept
   op nothing running reads is released, free; random and data-reading ops run
   when some dropped value was saved after them (the recompute stops at the
   last one). Storages are counted once however many views hold them; storages
   the region did not make (inputs, parameters, their views) count nothing.
   The torch.func engine replays every kept op and runs every other one, which
   is the same model with every output needed.
3. Chains are in the model: dropping a value whose producers are dropped too
   costs the whole chain back to kept values or inputs; keeping an op that
   only a running op reads costs its bytes. So the plan is not a per-op
   knapsack.
4. Solvers. Up to `EXACT_LIMIT` ops: a mixed-integer program (keep bits
   integer, run and hold bits continuous: they come out 0/1 from the keep
   bits), solved exactly by HiGHS through ``scipy.optimize.milp`` with no
   optimality gap: the recompute cost is optimal, so it never grows when the
   budget grows. HiGHS explores at most `NODE_LIMIT` branch-and-bound nodes;
   where the limit comes first, the better of its best solution and the
   rounding below is taken, and monotonicity is not proven for that region.
   Above: the LP relaxation, rounded at each distinct threshold
   and checked with `evaluate`; the best rounding that fits wins (keeping
   nothing always fits). Both are deterministic: a node limit, no time limit.
5. `evaluate` simulates the engine for a kept set; the plan reports its
   numbers (held bytes, recompute cost), which tests compare with what the
   engine then holds and recomputes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

__all__ = ["EXACT_LIMIT", "NODE_LIMIT", "Needed", "Outcome", "Program", "evaluate", "solve"]

#: Largest region (ops) planned exactly; larger ones get the rounded LP (NOTE rule 4).
EXACT_LIMIT = 600
#: Branch-and-bound nodes HiGHS may explore: a count, not a time, so the plan stays
#: the same on every machine (NOTE rule 4). A 2-layer BERT encoder needed ~90 s unbounded.
NODE_LIMIT = 200


@dataclasses.dataclass(frozen=True)
class Needed:
    """One output backward reads: its op, its storage (-1: not the region's) and clock."""

    op: int
    group: int
    clock: int


@dataclasses.dataclass(frozen=True)
class Program:
    """A region's forward as the planner sees it (NOTE rule 1)."""

    costs: tuple[int, ...]
    keepable: tuple[bool, ...]
    always_live: tuple[bool, ...]
    producers: tuple[tuple[int, ...], ...]
    #: The storages each op's outputs live in (indices into ``group_bytes``).
    groups: tuple[tuple[int, ...], ...]
    group_bytes: tuple[int, ...]
    needed: tuple[Needed, ...]

    @property
    def size(self) -> int:
        return len(self.costs)

    def full_bytes(self) -> int:
        """What the region holds when it keeps everything (everything-saveable)."""
        return sum(self.group_bytes[g] for g in {n.group for n in self.needed if n.group >= 0})


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A kept set and what it costs: held bytes, recompute cost, ops run again."""

    kept: frozenset[int]
    held_bytes: int
    cost: int
    runs: frozenset[int]
    solver: str = "evaluate"


def evaluate(program: Program, kept: Iterable[int], solver: str = "evaluate") -> Outcome:
    """Simulate the engine (NOTE rule 2) for the ops in ``kept``."""
    keep = frozenset(i for i in kept if program.keepable[i])
    dropped = [n for n in program.needed if n.op not in keep]
    clock = max((n.clock for n in dropped), default=0)
    live = [al and i < clock for i, al in enumerate(program.always_live)]
    for n in dropped:
        live[n.op] = True
    for i in range(program.size - 1, -1, -1):
        if live[i] and i not in keep:
            for p in program.producers[i]:
                live[p] = True
    held = {n.group for n in program.needed if n.op in keep and n.group >= 0}
    for i in keep:
        if live[i]:
            held.update(program.groups[i])
    runs = frozenset(i for i in range(program.size) if live[i] and i not in keep)
    read = {n.op for n in program.needed}
    return Outcome(
        # Kept ops nothing reads are released by the engine: the plan leaves them out.
        kept=frozenset(i for i in keep if live[i] or i in read),
        held_bytes=sum(program.group_bytes[g] for g in held),
        cost=sum(program.costs[i] for i in runs),
        runs=runs,
        solver=solver,
    )


def solve(program: Program, budget: int) -> Outcome:
    """The kept set within ``budget`` bytes with the least recompute cost (NOTE rule 4)."""
    everything = evaluate(program, range(program.size), "everything fits")
    if everything.held_bytes <= budget:
        return everything
    if not any(program.keepable):
        return evaluate(program, (), "nothing keepable")
    if program.size <= EXACT_LIMIT:
        return _exact(program, budget)
    return _rounded(program, budget)


# ---------------------------------------------------------------------------
# The mixed-integer program
# ---------------------------------------------------------------------------


class _Rows:
    """Sparse constraint rows ``lb <= a @ x <= ub``."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []

    def add(self, terms: list[tuple[int, float]], lb: float, ub: float) -> None:
        row = len(self.lb)
        for col, val in terms:
            self.rows.append(row)
            self.cols.append(col)
            self.vals.append(val)
        self.lb.append(lb)
        self.ub.append(ub)


def _model(program: Program, budget: int) -> tuple[np.ndarray, _Rows, np.ndarray, np.ndarray]:
    """Objective, constraints and bounds; variables: keep (n), run (n), hold (groups)."""
    n, inf = program.size, np.inf

    def k(i: int) -> int:
        return i

    def r(i: int) -> int:
        return n + i

    def h(g: int) -> int:
        return 2 * n + g

    rows = _Rows()
    for n_ in program.needed:  # a value backward reads is kept or recomputed
        rows.add([(k(n_.op), 1.0), (r(n_.op), 1.0)], 1.0, inf)
        if n_.group >= 0:
            rows.add([(h(n_.group), 1.0), (k(n_.op), -1.0)], 0.0, inf)
    for j in range(n):
        rows.add([(k(j), 1.0), (r(j), 1.0)], -inf, 1.0)  # a kept op is replayed, not run
        for p in set(program.producers[j]):
            rows.add([(k(p), 1.0), (r(p), 1.0), (r(j), -1.0)], 0.0, inf)
            for g in program.groups[p]:  # kept and read by a running op: held
                rows.add([(h(g), 1.0), (k(p), -1.0), (r(j), -1.0)], -1.0, inf)
    for j in (j for j in range(n) if program.always_live[j]):
        for op in sorted({n_.op for n_ in program.needed if n_.clock > j}):
            rows.add([(r(j), 1.0), (k(op), 1.0)], 1.0, inf)
    rows.add([(h(g), float(b)) for g, b in enumerate(program.group_bytes)], -inf, float(budget))
    cost = np.zeros(2 * n + len(program.group_bytes))
    cost[n : 2 * n] = program.costs
    upper = np.ones_like(cost)
    upper[:n] = [1.0 if keep else 0.0 for keep in program.keepable]
    return cost, rows, np.zeros_like(cost), upper


def _matrix(rows: _Rows, columns: int) -> object:
    from scipy.sparse import coo_array  # type: ignore[import-untyped]

    return coo_array((rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lb), columns)).tocsr()


def _exact(program: Program, budget: int) -> Outcome:
    from scipy.optimize import Bounds, LinearConstraint, milp  # type: ignore[import-untyped]

    cost, rows, lower, upper = _model(program, budget)
    integrality = np.zeros_like(cost)
    integrality[: program.size] = 1
    result = milp(
        cost,
        constraints=LinearConstraint(_matrix(rows, cost.size), rows.lb, rows.ub),
        integrality=integrality,
        bounds=Bounds(lower, upper),
        options={"mip_rel_gap": 0.0, "presolve": True, "node_limit": NODE_LIMIT},
    )
    if result.status == 0:  # proven optimal
        kept = [i for i in range(program.size) if result.x[i] > 0.5]
        return evaluate(program, kept, "exact (HiGHS MILP)")
    # The node limit came first: the better of HiGHS's best solution and the rounding.
    rounded = _rounded(program, budget)
    if result.x is None:
        return rounded
    kept = [i for i in range(program.size) if result.x[i] > 0.5]
    best = evaluate(program, kept, "HiGHS MILP at its node limit")
    return best if best.held_bytes <= budget and best.cost <= rounded.cost else rounded


def _rounded(program: Program, budget: int) -> Outcome:
    from scipy.optimize import linprog

    cost, rows, lower, upper = _model(program, budget)
    as_upper = _upper_rows(rows)
    result = linprog(
        cost,
        A_ub=_matrix(as_upper, cost.size),
        b_ub=as_upper.ub,
        bounds=list(zip(lower, upper, strict=True)),
        method="highs-ds",
    )
    best = evaluate(program, (), "rounded LP")
    if result.x is None:
        return best
    values = result.x[: program.size]
    thresholds = sorted({round(float(v), 6) for v in values if v > 1e-6}, reverse=True)
    for t in thresholds:
        candidate = evaluate(program, [i for i in range(program.size) if values[i] >= t - 1e-9],
                             "rounded LP")
        if candidate.held_bytes <= budget and candidate.cost < best.cost:
            best = candidate
    return best


def _upper_rows(rows: _Rows) -> _Rows:
    """Rows as ``a @ x <= b`` only: each finite lower bound negated, then each upper."""
    out = _Rows()
    by_row: dict[int, list[tuple[int, float]]] = {}
    for row, col, val in zip(rows.rows, rows.cols, rows.vals, strict=True):
        by_row.setdefault(row, []).append((col, val))
    for row, lb in enumerate(rows.lb):
        if np.isfinite(lb):
            out.add([(c, -v) for c, v in by_row.get(row, [])], -np.inf, -lb)
    for row, ub in enumerate(rows.ub):
        if np.isfinite(ub):
            out.add(by_row.get(row, []), -np.inf, ub)
    return out
