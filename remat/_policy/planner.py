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
   budget grows. HiGHS explores at most `NODE_LIMIT` branch-and-bound nodes.
   Where the limit comes first, and for regions above `EXACT_LIMIT`, the plan
   is the cheapest that fits of one *frontier* per program: kept sets found
   at `GRID` fixed budgets (``k / GRID`` of the full bytes) - the LP
   relaxation rounded at its thresholds, and, up to `EXACT_LIMIT` ops, the
   MILP's best solution there - plus keeping nothing. The frontier does not
   depend on the budget asked, so a larger budget chooses among a superset:
   these plans are monotone by construction (`Frontier`). (A budget proven
   optimal beside one planned from the frontier is compared with nothing: the
   frontier's plan is no worse than the optimum at each grid budget below
   it, not proven against off-grid ones.) Both are deterministic: a node
   limit, no time limit.
5. `evaluate` simulates the engine for a kept set; the plan reports its
   numbers (held bytes, recompute cost), which tests compare with what the
   engine then holds and recomputes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import numpy as np

__all__ = [
    "EXACT_LIMIT",
    "GRID",
    "NODE_LIMIT",
    "Frontier",
    "Needed",
    "Outcome",
    "Program",
    "evaluate",
    "frontier",
    "solve",
]

#: Largest region (ops) planned exactly; larger ones get the rounded LP (NOTE rule 4).
EXACT_LIMIT = 600
#: Branch-and-bound nodes HiGHS may explore: a count, not a time, so the plan stays
#: the same on every machine (NOTE rule 4). A 2-layer BERT encoder needed ~90 s unbounded.
NODE_LIMIT = 200
#: The frontier's fixed budgets: ``k / GRID`` of the full bytes (NOTE rule 4).
GRID = 8
#: Roundings tried per LP solution: at most this many thresholds, evenly spaced.
ROUNDINGS = 64


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
        exact = _exact(program, budget)
        if exact is not None:
            return exact
    return frontier(program).best(budget)


@dataclasses.dataclass(frozen=True)
class Frontier:
    """Kept sets found at fixed budgets, cheapest first among those that hold less.

    ``plans`` is sorted by held bytes, each cheaper than every one before it: the
    Pareto front of the candidates (NOTE rule 4).
    """

    plans: tuple[Outcome, ...]

    def best(self, budget: int) -> Outcome:
        """The cheapest plan within ``budget``: a larger budget never costs more."""
        fits = [p for p in self.plans if p.held_bytes <= budget]
        return fits[-1]  # keeping nothing (0 bytes) is always on the front


def frontier(program: Program) -> Frontier:
    """The program's frontier (NOTE rule 4); the same whichever budget asks first."""
    return _frontier(program, GRID, NODE_LIMIT, EXACT_LIMIT)


@functools.lru_cache(maxsize=16)
def _frontier(program: Program, grid: int, node_limit: int, exact_limit: int) -> Frontier:
    # The limits are part of the key: a frontier made under others is another one.
    full = program.full_bytes()
    candidates = [evaluate(program, (), "frontier")]
    for k in range(1, grid):
        grid_budget = full * k // grid
        candidates += _roundings(program, grid_budget)
        if program.size <= exact_limit:
            kept = _milp(program, grid_budget)[0]
            if kept is not None:
                candidates.append(evaluate(program, kept, "frontier"))
    front: list[Outcome] = []
    for c in sorted(candidates, key=lambda c: (c.held_bytes, c.cost, sorted(c.kept))):
        if not front or c.cost < front[-1].cost:
            front.append(dataclasses.replace(c, solver="frontier of fixed budgets"))
    return Frontier(tuple(front))


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


def _milp(program: Program, budget: int) -> tuple[list[int] | None, bool]:
    """HiGHS's kept set within ``budget`` (None if it found none) and whether it is optimal."""
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
    if result.x is None:
        return None, False
    kept = [i for i in range(program.size) if result.x[i] > 0.5]
    if evaluate(program, kept).held_bytes > budget:
        return None, False
    return kept, result.status == 0


def _exact(program: Program, budget: int) -> Outcome | None:
    """The proven optimum within ``budget``, or None where the node limit came first."""
    kept, optimal = _milp(program, budget)
    if kept is None or not optimal:
        return None
    return evaluate(program, kept, "exact (HiGHS MILP)")


def _roundings(program: Program, budget: int) -> list[Outcome]:
    """The LP relaxation at ``budget``, rounded at up to `ROUNDINGS` thresholds; those that fit."""
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
    if result.x is None:
        return []
    values = result.x[: program.size]
    thresholds = sorted({round(float(v), 6) for v in values if v > 1e-6}, reverse=True)
    if len(thresholds) > ROUNDINGS:
        step = len(thresholds) / ROUNDINGS
        thresholds = [thresholds[int(i * step)] for i in range(ROUNDINGS)]
    out = []
    for t in thresholds:
        kept = [i for i in range(program.size) if values[i] >= t - 1e-9]
        candidate = evaluate(program, kept, "rounded LP")
        if candidate.held_bytes <= budget:
            out.append(candidate)
    return out


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
