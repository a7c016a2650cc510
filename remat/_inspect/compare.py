"""`compare`: what each policy costs on one training step (memory, recompute, time).

The public functions, and the table and the plot of their rows. How the rows
are measured: NOTE [ How compare measures ] in ``_inspect/costs.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from .costs import PolicyCost, costs
from .guard import check_keywords
from .residual import table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PolicyCost", "compare", "format_costs", "plot_costs", "policy_costs"]

_OPTIONS = ("policies", "where", "repeats", "progress")


def policy_costs(
    fn: Callable[..., Any],
    *args: Any,
    policies: str | Sequence[Any] = ("nothing-saveable", "dots-saveable", "everything-saveable"),
    where: Any = None,
    repeats: int = 5,
    progress: bool | None = None,
    **kwargs: Any,
) -> list[PolicyCost]:
    """Measure memory, recompute and time of ``fn``'s forward+backward under each policy.

    The first row is always no remat (``"none"``). The loss is the sum of every
    floating-point tensor ``fn`` returns. Memory is exact on CPU (tensor storages;
    the arguments and parameters are the baseline, not counted) and comes from
    the CUDA allocator on CUDA. The random generators, module buffers and the
    ``.grad`` of every differentiated tensor are as they were afterwards.

    Args:
        fn (callable): the function or module.
        *args (Any): its positional arguments.
        policies (str | sequence, optional): one policy, or a sequence of them, in
            any form ``remat.remat`` accepts. Default: nothing-, dots- and
            everything-saveable.
        where (type | tuple of types | callable, optional): apply each policy per
            block of the module ``fn``, to the submodules ``where`` selects (as
            `remat.apply` does), instead of one region around the whole call.
        repeats (int, optional): timed rounds, each running every variant once.
            Default: 5.
        progress (bool, optional): one line per variant on stderr. Default: on
            when stderr is a terminal.
        **kwargs (Any): its keyword arguments.

    Returns:
        list[PolicyCost]: no remat first, then one row per policy.

    Raises:
        TypeError: a keyword neither this function nor ``fn`` accepts; ``where``
            given with an ``fn`` that is not an ``nn.Module``.
        ValueError: ``where`` given for a module that already has wrapped submodules.

    Examples:
        >>> import torch
        >>> w = torch.randn(16, 16, requires_grad=True)
        >>> rows = policy_costs(lambda x: torch.tanh(x @ w) @ w, torch.randn(4, 16),
        ...                     policies="nothing-saveable", repeats=1)
        >>> [r.policy for r in rows], rows[1].held_bytes < rows[0].held_bytes
        (['none', 'nothing-saveable'], True)
    """
    check_keywords("remat.policy_costs", fn, kwargs, _OPTIONS)
    return costs("remat.policy_costs", fn, args, kwargs, policies, where, repeats, progress)


@overload
def compare(
    fn: Callable[..., Any],
    *args: Any,
    policies: str | Sequence[Any] = ...,
    where: Any = ...,
    repeats: int = ...,
    plot: Literal[False] = ...,
    progress: bool | None = ...,
    **kwargs: Any,
) -> list[PolicyCost]: ...


@overload
def compare(
    fn: Callable[..., Any],
    *args: Any,
    policies: str | Sequence[Any] = ...,
    where: Any = ...,
    repeats: int = ...,
    plot: Literal[True],
    progress: bool | None = ...,
    **kwargs: Any,
) -> tuple[list[PolicyCost], Figure]: ...


def compare(
    fn: Callable[..., Any],
    *args: Any,
    policies: str | Sequence[Any] = ("nothing-saveable", "dots-saveable", "everything-saveable"),
    where: Any = None,
    repeats: int = 5,
    plot: bool = False,
    progress: bool | None = None,
    **kwargs: Any,
) -> list[PolicyCost] | tuple[list[PolicyCost], Figure]:
    """Print a table of what each policy costs on ``fn(*args, **kwargs)``; return its rows.

    Takes the arguments of `policy_costs`, and ``plot``.

    Args:
        fn (callable): the function or module.
        *args (Any): its positional arguments.
        policies (str | sequence, optional): one policy, or a sequence of them.
        where (type | tuple of types | callable, optional): compare per-block
            application on the module ``fn`` (see `policy_costs`).
        repeats (int, optional): timed rounds. Default: 5.
        plot (bool, optional): also return a matplotlib ``Figure`` of the rows
            (needs the ``plot`` extra: ``pip install remat[plot]``). Default: False.
        progress (bool, optional): one line per variant on stderr. Default: on
            when stderr is a terminal.
        **kwargs (Any): its keyword arguments.

    Returns:
        list[PolicyCost], or ``(rows, figure)`` with ``plot=True``.

    Examples:
        >>> import torch
        >>> w = torch.randn(16, 16, requires_grad=True)
        >>> rows = compare(lambda x: torch.tanh(x @ w), torch.randn(4, 16),
        ...                policies=["nothing-saveable"], repeats=1)  # doctest: +ELLIPSIS
        policy            held bytes  peak bytes  recomputed ops  time vs none
        none                     ...
    """
    check_keywords("remat.compare", fn, kwargs, (*_OPTIONS, "plot"))
    rows = costs("remat.compare", fn, args, kwargs, policies, where, repeats, progress)
    print(format_costs(rows))
    if plot:
        return rows, plot_costs(rows)
    return rows


def format_costs(rows: Sequence[PolicyCost]) -> str:
    """Format `policy_costs` rows as a plain-text table.

    Examples:
        >>> print(format_costs([PolicyCost("none", 2048, 4096, 0, 1.0)]))
        policy  held bytes  peak bytes  recomputed ops  time vs none
        none         2,048       4,096               0   1.00x ±0.00
    """
    header = ("policy", "held bytes", "peak bytes", "recomputed ops", "time vs none")
    cells = [header] + [
        (
            r.policy,
            f"{r.held_bytes:,}",
            f"{r.peak_bytes:,}",
            f"{r.recomputed_ops:,}",
            f"{r.time_ratio:.2f}x ±{r.time_spread:.2f}",
        )
        for r in rows
    ]
    return table(cells, numeric={1, 2, 3, 4})


def plot_costs(rows: Sequence[PolicyCost]) -> Figure:
    """Draw `policy_costs` rows: peak and held bytes, and time (median, and every round's range).

    Needs matplotlib (the ``plot`` extra). The figure is made without pyplot, so
    no window opens and no backend needs choosing: save it with ``savefig``.

    Examples:
        >>> fig = plot_costs([PolicyCost("none", 2048, 4096, 0, 1.0),
        ...                   PolicyCost("nothing-saveable", 8, 2100, 12, 1.3, 0.1)])
        >>> [ax.get_title() for ax in fig.axes]
        ['memory (bytes)', 'time vs none']
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - the extra is installed in CI
        raise ImportError(
            "remat.compare(plot=True) needs matplotlib: pip install 'remat[plot]'"
        ) from error
    labels = [r.policy for r in rows]
    positions = list(range(len(rows)))
    fig = Figure(figsize=(4 + 1.2 * len(rows), 3.5), layout="constrained")
    memory, timing = fig.subplots(1, 2)
    width = 0.4
    memory.bar([p - width / 2 for p in positions], [r.peak_bytes for r in rows], width,
               label="peak")
    memory.bar([p + width / 2 for p in positions], [r.held_bytes for r in rows], width,
               label="held after forward")
    memory.set_title("memory (bytes)")
    memory.legend()
    # The bars are medians; the whiskers span every round's ratio (min to max).
    low = [r.time_ratio - min(r.time_ratios, default=r.time_ratio) for r in rows]
    high = [max(r.time_ratios, default=r.time_ratio) - r.time_ratio for r in rows]
    timing.bar(positions, [r.time_ratio for r in rows], 0.6, yerr=[low, high], capsize=4)
    timing.axhline(1.0, color="grey", linewidth=0.8)
    timing.set_title("time vs none")
    timing.set_ylim(bottom=0)
    for ax in (memory, timing):
        ax.set_xticks(positions, labels, rotation=30, ha="right")
    return fig
