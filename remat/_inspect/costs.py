"""Measuring what each policy costs: the variants, their memory, recompute and time.

NOTE [ How compare measures ]
1. Variants. The first row is always no remat (``"none"``). Without ``where``,
   each policy is one region around the whole call (``remat.remat(fn,
   policy=p)``). With ``where`` (a type or predicate, as in `remat.apply`) ``fn``
   is a module and each policy is applied per block, in place, for the
   variant's steps only (`remat.apply`, then `remat.unwrap`): so on a full
   model, policies differ as they do in training.
2. Gradients. One forward of no remat finds the leaves the step differentiates
   (the graph's ``AccumulateGrad`` nodes); their ``.grad`` is set aside and set
   to None before every step, so every row counts its gradients alike, and put
   back at the end: the user's gradients are as they were.
3. Memory is measured once per variant by `measure_memory` (exact on CPU);
   recomputed ops are the backward's aten compute ops beyond no remat's.
4. Time. ``repeats`` rounds, each running every variant once, interleaved,
   after one untimed warm-up round; each round gives each policy a ratio to no
   remat's time in the same round. A row
   shows the median ratio and its spread (half the range of the ratios): the
   spread says how far to trust a ratio on a busy machine.
5. Progress: one line per variant (and one for the timing) on stderr, on by
   default when stderr is a terminal; ``progress=True/False`` forces it.
6. Like `saved_residuals`, `compare` leaves the random generators and module
   buffers as it found them (``_inspect/guard.py``), and checks its keywords.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch import nn

from .. import policies as _policies
from .guard import preserved_state
from .memory import ComputeOpCounter, measure_memory
from .residual import human

__all__ = ["PolicyCost", "costs"]


@dataclasses.dataclass(frozen=True)
class PolicyCost:
    """What one policy costs on one call, measured by `policy_costs`.

    Attributes:
        policy (str): the policy as given (``"none"`` for no remat).
        held_bytes (int): bytes alive after the forward (held for backward, plus outputs).
        peak_bytes (int): the most bytes alive during forward and backward
            (gradients included).
        recomputed_ops (int): aten compute ops the backward runs beyond no remat's backward.
        time_ratio (float): median over the repeats of the step time over no
            remat's in the same repeat.
        time_spread (float): half the range (max - min) of those ratios over the repeats.
        time_ratios (tuple of float): the ratio in each round, in order.
    """

    policy: str
    held_bytes: int
    peak_bytes: int
    recomputed_ops: int
    time_ratio: float
    time_spread: float = 0.0
    time_ratios: tuple[float, ...] = ()


@dataclasses.dataclass
class _Variant:
    """No remat, or one policy: how to run its step (NOTE rule 1)."""

    label: str
    fn: Callable[..., Any]
    #: Per-block application: (module, policy, where), applied while the variant runs.
    blocks: tuple[nn.Module, Any, Any] | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.blocks is None:
            yield
            return
        from .._apply import apply
        from .._modules import unwrap

        module, policy, where = self.blocks
        apply(module, policy=policy, where=where)
        try:
            yield
        finally:
            unwrap(module)


def costs(
    api: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    policies: str | Sequence[Any],
    where: Any,
    repeats: int,
    progress: bool | None,
) -> list[PolicyCost]:
    """Measure every variant's step: no remat, then one row per policy (NOTE rules 1-5).

    ``api`` is the public function that asks, for its messages.
    """
    chosen = _policy_list(api, policies)
    variants = _variants(api, fn, chosen, where)
    say = _progress(api, progress)
    with preserved_state(fn, args, kwargs), _grads_set_aside(fn, args, kwargs) as clear:
        measured: dict[str, tuple[int, int, int]] = {}
        for number, variant in enumerate(variants, 1):
            start = time.perf_counter()
            step = _loss_fn(variant.fn, kwargs)
            with variant.active():
                clear()
                report = measure_memory(step, *args)
                clear()
                ops = _backward_ops(step, args)
            measured[variant.label] = (report.held_bytes, report.peak_bytes, ops)
            say(
                f"[{number}/{len(variants)}] {variant.label}: peak {human(report.peak_bytes)}, "
                f"held {human(report.held_bytes)} ({time.perf_counter() - start:.2f} s)"
            )
        ratios = _time(variants, args, kwargs, repeats, clear, say)
    none_ops = measured["none"][2]
    return [
        PolicyCost(
            v.label,
            measured[v.label][0],
            measured[v.label][1],
            measured[v.label][2] - none_ops,
            statistics.median(ratios[v.label]),
            (max(ratios[v.label]) - min(ratios[v.label])) / 2,
            tuple(ratios[v.label]),
        )
        for v in variants
    ]


def _policy_list(api: str, policies: str | Sequence[Any]) -> list[Any]:
    """A bare string or `Policy` is one policy, not a sequence of characters."""
    if isinstance(policies, str | _policies.Policy) or callable(policies):
        return [policies]
    if not isinstance(policies, Sequence):
        raise TypeError(f"{api}: policies must be a policy or a sequence of them, got {policies!r}")
    for policy in policies:
        _policies.resolve(policy)  # a bad policy raises before anything runs
    return list(policies)


def _variants(api: str, fn: Callable[..., Any], chosen: list[Any], where: Any) -> list[_Variant]:
    from .._api import remat as remat_fn
    from .._modules import is_wrapped

    variants = [_Variant("none", fn)]
    if where is None:
        return variants + [_Variant(_label(p), remat_fn(fn, policy=p)) for p in chosen]
    if not isinstance(fn, nn.Module):
        raise TypeError(
            f"{api}: where= applies each policy per block of a module, but fn is "
            f"{type(fn).__name__}; pass the nn.Module itself, or drop where= to compare "
            "one region around the whole call."
        )
    wrapped = [name or "<root>" for name, m in fn.named_modules() if is_wrapped(m)]
    if wrapped:
        raise ValueError(
            f"{api}: where= applies each policy itself, but {fn.__class__.__name__} has "
            f"wrapped submodules already ({', '.join(wrapped[:3])}"
            f"{', ...' if len(wrapped) > 3 else ''}); call remat.unwrap(model) first."
        )
    return variants + [_Variant(_label(p), fn, (fn, p, where)) for p in chosen]


def _time(
    variants: list[_Variant],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    repeats: int,
    clear: Callable[[], None],
    say: Callable[[str], None],
) -> dict[str, list[float]]:
    """Per round, each variant's step time over no remat's (NOTE rule 4)."""
    start = time.perf_counter()
    ratios: dict[str, list[float]] = collections.defaultdict(list)
    for round_ in range(max(1, repeats) + 1):
        seconds = {}
        for variant in variants:
            step = _loss_fn(variant.fn, kwargs)
            with variant.active():
                clear()
                begin = time.perf_counter()
                step(*args).backward()
                seconds[variant.label] = time.perf_counter() - begin
        if round_ == 0:
            continue  # a warm-up round: first calls (allocator, caches) are not the policy's
        for label, spent in seconds.items():
            ratios[label].append(spent / seconds["none"])
    rounds = max(1, repeats)
    say(f"timed {rounds} round{'s' if rounds > 1 else ''} ({time.perf_counter() - start:.2f} s)")
    return ratios


def _progress(api: str, progress: bool | None) -> Callable[[str], None]:
    show = sys.stderr.isatty() if progress is None else progress

    def say(line: str) -> None:
        if show:
            print(f"{api}: {line}", file=sys.stderr, flush=True)

    return say


@contextlib.contextmanager
def _grads_set_aside(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[Callable[[], None]]:
    """Find the differentiated leaves; yield a function that clears their ``.grad`` (rule 2)."""
    with torch.enable_grad():
        loss = _loss_fn(fn, kwargs)(*args)
    leaves = _leaves_of(loss)
    del loss
    kept = [(leaf, leaf.grad) for leaf in leaves]

    def clear() -> None:
        for leaf in leaves:
            leaf.grad = None

    try:
        yield clear
    finally:
        for leaf, grad in kept:
            leaf.grad = grad


def _leaves_of(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors whose ``.grad`` a backward from ``loss`` accumulates into."""
    leaves: list[torch.Tensor] = []
    seen: set[Any] = set()
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _label(policy: Any) -> str:
    return policy if isinstance(policy, str) else repr(_policies.resolve(policy))


def _loss_fn(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def loss(*args: Any) -> torch.Tensor:
        leaves = optree.tree_leaves(fn(*args, **kwargs))
        floats = [t.sum() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return torch.stack(floats).sum()

    return loss


def _backward_ops(step: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> int:
    loss = step(*args)
    with ComputeOpCounter() as counter:
        loss.backward()
    return int(counter.count)
