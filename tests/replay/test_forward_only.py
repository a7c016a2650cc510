"""Forward-only ops and lazily built constants under the op-tracing policies.

NOTE [ Ops the recompute may skip ] in ``remat/_replay/alignment.py``: a recompute
may leave out ops whose results reach only Python numbers, and ops building a
constant from nothing the region reads when it reads the forward's tensor; any
other difference raises. Both engines, every op-tracing policy, against no remat.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch

import remat
from tests.conftest import Engine
from tests.helpers import RecomputeCounter, assert_recomputed

#: The policies that record ops, and nothing-saveable (which records none) as a control.
POLICIES = ("nothing-saveable", "dots-saveable", "budget:0.3", "save-last", "save:hidden")


def _weights() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64) for s in ((8, 16), (16, 8)))


def _run(
    engine: Engine, fn: Callable[..., torch.Tensor], policy: str, *ws: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], collections.Counter[str]]:
    """Gradients of ``fn``'s sum in ``policy`` (and its recomputed ops), as the engine runs it."""
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    region = engine.remat(fn, policy=policy)
    with RecomputeCounter() as counter:
        got = engine.grads(lambda *w: region(x, *w).sum(), *ws)
    return got, counter.counts


def _expected(fn: Callable[..., torch.Tensor], *ws: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    leaves = [w.detach().requires_grad_() for w in ws]
    return torch.autograd.grad(fn(x, *leaves).sum(), leaves)


def _check(
    engine: Engine, fn: Callable[..., torch.Tensor], policy: str, claims: bool = True
) -> collections.Counter[str]:
    """Check the gradients against no remat and, with ``claims``, what ``policy`` reran."""
    ws = _weights()
    expected = _expected(fn, *ws)
    got, counts = _run(engine, fn, policy, *ws)
    torch.testing.assert_close(got, expected)
    if claims:
        _assert_recomputed(policy, counts, lambda: _run(engine, fn, "nothing-saveable", *ws)[1])
    return counts


def _assert_recomputed(
    policy: str,
    counts: collections.Counter[str],
    everything: Callable[[], collections.Counter[str]],
) -> None:
    if policy.startswith("budget:"):  # its plan keeps some, recomputes the rest
        assert 0 < sum(counts.values()) <= sum(everything().values()), counts
    else:
        assert_recomputed(policy, counts, everything)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_statistic_logged_only_in_the_forward(engine: Engine, policy: str) -> None:
    """The docs' recipe: ``if not remat.is_recomputing(): log(h.detach().norm().item())``."""
    log: list[float] = []

    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
        if not remat.is_recomputing():
            log.append(h.detach().norm().item())
        return torch.sin(h @ w2)

    counts = _check(engine, f, policy)
    assert counts["linalg_vector_norm"] == 0 and counts["_local_scalar_dense"] == 0
    assert len(log) >= 2 and log == pytest.approx([log[0]] * len(log))  # forwards only


@pytest.mark.parametrize("policy", POLICIES)
def test_a_forward_only_matmul_of_the_real_ones_shape(engine: Engine, policy: str) -> None:
    """A forward-only ``h.detach() @ v`` before the needed ``h @ w2`` of the same shapes.

    Matched by a per-op counter (torch's selective checkpoint), the recompute's
    ``h @ w2`` would get the statistic's kept product: wrong, silently.
    """
    v = torch.randn(16, 8, dtype=torch.float64)

    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
        if not remat.is_recomputing():
            (h.detach() @ v).sum().item()
        return torch.sin(h @ w2)

    counts = _check(engine, f, policy, claims=policy != "dots-saveable")
    if policy == "dots-saveable":
        # The recompute's h @ w2 fits both forward matmuls: it runs rather than
        # replay either's output (the cost of that safety: one matmul).
        # (The eager engine holds the kept x @ w1 and h @ w2 for backward: its
        # recompute stops once it has tanh's output, before any matmul.)
        assert counts["mm"] == (0 if engine.name == "eager" else 1)


def test_a_statistic_the_recompute_also_computes(engine: Engine) -> None:
    """Unguarded, the statistic is the forward's op in the recompute too: replayed."""
    log: list[float] = []
    v = torch.randn(16, 3, dtype=torch.float64)

    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w1)
        log.append((h.detach() @ v).sum().item())
        return torch.sin(h @ w2)

    counts = _check(engine, f, "dots-saveable")
    assert counts["mm"] == 0


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_statistic_reading_a_weight(engine: Engine, policy: str, grad: bool) -> None:
    """Autograd records a statistic on a weight (``grad``): the eager engine's forward
    saves tensors for it that its recompute does not, and are dropped with the
    statistic's graph: the recompute leaves them out (NOTE [ Saved tensors the
    recompute may skip ]). Under ``torch.no_grad()`` nothing is saved for it.
    """
    log: list[float] = []

    def region(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
        if not remat.is_recomputing():
            with torch.set_grad_enabled(grad):
                log.append((h.detach() @ w2).sum().item())
        return torch.sin(h @ w2)

    # Recorded, the eager engine's in-place recompute fails first; the second one runs
    # what the first replayed and released (NOTE rule 4): only the gradients are claimed.
    skipped = engine.name == "eager" and grad and policy != "save-last"
    # (A recompute's h @ w2 fits this statistic's matmul too: under dots-saveable it
    # runs, as in `test_a_forward_only_matmul_of_the_real_ones_shape`.)
    counts = _check(engine, region, policy, claims=not skipped and policy != "dots-saveable")
    if policy == "dots-saveable" and not skipped:
        assert counts["mm"] <= 1, counts
    assert len(log) >= 2 and log == pytest.approx([log[0]] * len(log))  # forwards only
    assert counts["_local_scalar_dense"] == 0 and counts["sum"] == 0
    if skipped:
        assert 0 < sum(counts.values()) <= 3 * sum(_run(engine, region, "nothing-saveable",
                                                        *_weights())[1].values())


@pytest.mark.parametrize("policy", POLICIES)
def test_the_docs_statistic_on_a_tensor_that_requires_grad(engine: Engine, policy: str) -> None:
    """The docs' recipe without ``detach``: ``stats.append(h.norm().item())``."""
    log: list[float] = []

    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
        if not remat.is_recomputing():
            log.append(h.norm().item())
        return torch.sin(h @ w2)

    # (The eager engine's recompute that leaves the statistic's saved tensors out runs
    # what the failed first one replayed: only the gradients are claimed there.)
    counts = _check(engine, f, policy, claims=engine.name == "functional" or policy == "save-last")
    assert counts["linalg_vector_norm"] == 0 and counts["_local_scalar_dense"] == 0
    assert len(log) >= 2 and log == pytest.approx([log[0]] * len(log))


def test_a_statistic_whose_graph_is_kept_raises() -> None:
    """A statistic tensor kept alive keeps its saved tensors: backward may read them, so
    the recompute may not leave them out. It raises, naming the fixes; ending the
    statistic in ``.item()`` works."""
    kept: list[Any] = []

    def f(number: bool) -> Callable[..., torch.Tensor]:
        def region(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
            h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
            if not remat.is_recomputing():
                kept.append(h.norm().item() if number else h.norm())
            return torch.sin(h @ w2)

        return region

    eager = Engine("eager")
    for policy in POLICIES[:3]:  # none keeps the statistic's norm: each recomputes
        with pytest.raises(remat.NondeterministicRecomputeError, match=r"\.item\(\)|no_grad"):
            _check(eager, f(False), policy)
    assert kept[0].requires_grad
    kept.clear()
    for policy in POLICIES:
        _check(eager, f(True), policy, claims=policy == "save-last")


CACHE: dict[str, torch.Tensor] = {}


def _lazy(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    if "inv" not in CACHE:  # a rotary-style table, built on the first call
        CACHE["inv"] = 1.0 / (10000 ** (torch.arange(0, 16, dtype=torch.float64) / 16))
    h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
    return torch.sin(h * CACHE["inv"]) @ w2


@pytest.mark.parametrize("policy", POLICIES)
def test_a_constant_built_on_the_first_call(engine: Engine, policy: str) -> None:
    CACHE.clear()
    ws = _weights()
    expected = _expected(_lazy, *ws)
    CACHE.clear()
    got, counts = _run(engine, _lazy, policy, *ws)
    torch.testing.assert_close(got, expected)
    assert counts["arange"] == counts["pow"] == 0
    if policy != "nothing-saveable":
        _assert_recomputed(policy, counts, lambda: _run(engine, _lazy, "nothing-saveable", *ws)[1])


def test_a_lazy_constant_written_after_the_forward_raises() -> None:
    """The forward's table, written in place before backward: not the forward's value."""
    CACHE.clear()
    ws = [w.requires_grad_() for w in _weights()]
    x = torch.randn(4, 8, dtype=torch.float64)
    out = remat.remat(_lazy, policy="dots-saveable", engine="eager")(x, *ws).sum()
    with torch.no_grad():
        CACHE["inv"].mul_(2)
    with pytest.raises(remat.NondeterministicRecomputeError, match="register_buffer"):
        out.backward()


BASE = torch.arange(16, dtype=torch.float64) / 16
TABLES: dict[str, torch.Tensor] = {}


def _from_buffer(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    if "cos" not in TABLES:  # built on the first call from a tensor the region reads
        TABLES["cos"] = torch.cos(BASE)
    return torch.sin(torch.tanh(x @ w1) * TABLES["cos"]) @ w2


def test_a_lazy_table_from_an_untracked_tensor_the_region_reads_is_a_constant(
    engine: Engine,
) -> None:
    """``BASE`` requires no grad: the table is a constant, read as the forward's tensor."""
    ws = _weights()
    expected = _expected(_from_buffer, *ws)
    TABLES.clear()
    got, counts = _run(engine, _from_buffer, "dots-saveable", *ws)
    torch.testing.assert_close(got, expected)
    assert counts["cos"] == 0 and counts["mm"] == 0 and counts["tanh"] == 1, counts


def _from_tracked(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    if "cos" not in TABLES:  # built on the first call from a tensor requiring grad
        TABLES["cos"] = torch.cos(w1[0])
    return torch.sin(torch.tanh(x @ w1) * TABLES["cos"]) @ w2


def test_a_lazy_table_from_a_tensor_requiring_grad_raises_naming_the_fix(
    engine: Engine,
) -> None:
    """Not a constant (it reads ``w1``): raises, and a fix the message names works
    (the table as state built outside the region, with the gradient it then has)."""
    ws = _weights()
    TABLES.clear()
    with pytest.raises(remat.RematError, match="Usual causes and their fixes"):
        _run(engine, _from_tracked, "dots-saveable", *ws)
    TABLES["cos"] = torch.cos(ws[0][0]).detach()  # the fix: build it before the region
    expected = _expected(_from_tracked, *ws)
    got, counts = _run(engine, _from_tracked, "dots-saveable", *ws)
    torch.testing.assert_close(got, expected)
    assert counts["mm"] == 0 and counts["tanh"] == 1


# ---------------------------------------------------------------------------
# What must still raise
# ---------------------------------------------------------------------------

#: The op-tracing policies that recompute (a last save-last region recomputes nothing).
RAISING = ("dots-saveable", "budget:0.3", "save:hidden")


def _raises(engine: Engine, fn: Callable[..., Any], policy: str) -> None:
    ws = _weights()
    with pytest.raises(remat.NondeterministicRecomputeError):
        _run(engine, fn, policy, *ws)


@pytest.mark.parametrize("policy", RAISING)
def test_a_forward_only_value_reaching_a_kept_op_raises(engine: Engine, policy: str) -> None:
    """The forward scales by a statistic the recompute replaces: the gradients differ."""

    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
        scale = h.detach().norm() if not remat.is_recomputing() else torch.ones((), dtype=h.dtype)
        return torch.sin((h * scale) @ w2)

    _raises(engine, f, policy)


@pytest.mark.parametrize("policy", RAISING)
def test_a_forward_only_number_passed_to_an_op_raises(engine: Engine, policy: str) -> None:
    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
        scale = h.detach().norm().item() if not remat.is_recomputing() else 1.0
        return torch.sin((h * scale) @ w2)

    _raises(engine, f, policy)


@pytest.mark.parametrize("policy", RAISING)
def test_a_branch_that_drops_a_same_shaped_matmul_raises(engine: Engine, policy: str) -> None:
    """The recompute takes the other side of a data-dependent branch: one matmul fewer.

    Its ``h @ w2`` has the shapes of both the forward-only matmul and the needed
    ``h @ w3`` that it skips; no reading of it fits what follows.
    """
    w3 = torch.randn(16, 16, dtype=torch.float64)
    threshold = [float("-inf")]

    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
        if not remat.is_recomputing():
            (h.detach() @ w3).sum().item()
        if h.sum().item() > threshold[0]:
            h = torch.tanh(h @ w3)
        threshold[0] = float("inf")  # the recompute takes the other branch
        return torch.sin(h @ w2)

    _raises(engine, f, policy)
