"""The one module of shared test helpers (every test folder imports it as ``helpers``).

Policies every engine test runs under, example programs and inputs, references
without remat (`grads`, `check_remat`, `train_both`), comparisons
(`assert_close_all`, `tree_close`), op counters (`OpCounter`, `RecomputeCounter`
with `assert_recomputed`) and script loading. Process groups for the
distributed tests: ``tests/distributed/process_group.py``.
"""

from __future__ import annotations

import collections
import importlib.util
import pathlib
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat._offload.fake import FakeHostStore
from remat._policy.op_cost import op_cost
from remat._replay.checks import arg_shapes

#: Policies every engine test runs under (strings, as users write them).
POLICIES = (
    "nothing-saveable",
    "everything-saveable",
    "dots-saveable",
    "dots-no-batch-saveable",
    "save:hidden",
    "save-except:hidden",
    "everything-except:hidden",
    "save-last",
    "save-last+dots-saveable",
    "offload-dots",
)

#: The four ways a policy decides: recompute all, keep by op, keep the last region,
#: keep by name (programs name their value ``"hidden"``).
CORE_POLICIES = ("nothing-saveable", "dots-saveable", "save-last", "save:hidden")
#: The core ones, a name recomputed while the rest is kept, and offload.
WIDE_POLICIES = (*CORE_POLICIES, "everything-except:hidden", "offload-dots")


class OpCounter(TorchDispatchMode):
    """Count aten ops by short name (``mm``, ``gelu``, ...) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


#: aten ops (by short name) that multiply matrices without batch dimensions: what
#: ``dots-no-batch-saveable`` keeps (the table `tests/policy/test_ops.py` checks).
NO_BATCH_DOTS = frozenset({"mm", "addmm", "_addmm_activation", "mv", "addmv", "dot", "vdot"})
#: Every dot: the no-batch ones, batched matmuls, convolutions, fused attention.
DOTS = NO_BATCH_DOTS | {
    "bmm", "baddbmm", "addbmm", "convolution", "_convolution", "mkldnn_convolution",
    "_slow_conv2d_forward", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
}


_NO_COMPUTE = frozenset(
    {torch.ops.aten.detach, torch.ops.aten.empty, torch.ops.aten.empty_strided}
)


class RecomputeCounter(TorchDispatchMode):
    """Count the compute ops run while a region is recomputed.

    Enter it around a forward and its backward: only ops run under
    `remat.is_recomputing()` count, so a remat that recomputes nothing counts 0.
    Views, detaches and bare allocations compute nothing and are not counted (the
    eager replay allocates a stand-in, ``empty_strided``, for a value it replays).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if remat.is_recomputing() and not (func.is_view or func.overloadpacket in _NO_COMPUTE):
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def assert_recomputed(
    policy: str,
    counts: collections.Counter[str],
    everything: Callable[[], collections.Counter[str]],
    *,
    last: bool = True,
) -> None:
    """Assert that what a single region recomputed in backward is what ``policy`` implies.

    ``counts``: the region's recomputed ops (`RecomputeCounter`); ``everything``: the
    same run's counts under ``nothing-saveable`` (called only for the policies that
    are claimed relative to it). ``last``: whether the region ran last (a ``save-last``
    region then keeps everything; otherwise it is demoted to its base policy).
    """
    total, dots = sum(counts.values()), sum(n for op, n in counts.items() if op in DOTS)
    if policy.startswith("save-last"):
        if last:
            assert total == 0, f"{policy}: the last region keeps everything, reran {counts}"
            return
        policy = policy.removeprefix("save-last").removeprefix("+") or "nothing-saveable"
    if policy == "everything-saveable":
        assert total == 0, f"{policy} reran {counts}"
    elif policy in ("nothing-saveable", "save-except:hidden"):
        # save-except:hidden saves only the names other than hidden: there are none.
        assert total > 0, f"{policy} reran nothing"
        if policy != "nothing-saveable":
            assert counts == everything(), f"{policy} reran {counts}"
    elif policy in ("dots-saveable", "offload-dots"):
        assert total > 0 and dots == 0, f"{policy} reran {counts}"
    elif policy == "dots-no-batch-saveable":
        no_batch = sum(n for op, n in counts.items() if op in NO_BATCH_DOTS)
        assert total > 0 and no_batch == 0, f"{policy} reran {counts}"
    elif policy == "save:hidden":
        full = sum(everything().values())
        assert 0 < total < full, f"{policy} reran {total} ops of {full}: {counts}"
    elif policy == "everything-except:hidden":
        full = sum(everything().values())
        assert dots == 0 and total < full, f"{policy} reran {total} ops of {full}: {counts}"
    else:
        raise AssertionError(f"no recompute claim for {policy!r}: add one here")


def grads(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], seed: int = 0,
          create_graph: bool = False) -> tuple[torch.Tensor, ...]:
    """Gradients of ``fn(*inputs).sum()`` (after seeding) w.r.t. ``inputs``."""
    torch.manual_seed(seed)
    out = fn(*inputs)
    return torch.autograd.grad(out.sum(), inputs, create_graph=create_graph)


def assert_close_all(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def assert_close_each(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    """Each pair close with torch's default tolerances for its dtype.

    Tighter than `assert_close_all` (a fixed 1e-5) in float64.
    """
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)


def assert_close_or_unused(
    actual: Sequence[torch.Tensor | None], expected: Sequence[torch.Tensor | None]
) -> None:
    """`assert_close_all` where ``expected`` has None for an input the program does not use.

    There ``actual`` may be None or zeros (an engine may return either for an unused input).
    """
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        if e is None:
            assert a is None or not torch.any(a)  # an unused input
        else:
            assert a is not None
            torch.testing.assert_close(a, e)


# -- example programs: (fn, make_inputs) -------------------------------------

def _named(x: torch.Tensor) -> torch.Tensor:
    return remat.checkpoint_name(x, "hidden")


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = _named(torch.tanh(x @ w1))
    return torch.sin(h @ w2) * x


def attention_sdpa(x: torch.Tensor, wqkv: torch.Tensor) -> torch.Tensor:
    q, k, v = (x @ wqkv).reshape(2, 5, 3, 4).unbind(2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _named(out).exp()


def attention_bmm(x: torch.Tensor, wqkv: torch.Tensor) -> torch.Tensor:
    q, k, v = (x @ wqkv).reshape(2, 5, 3, 4).unbind(2)
    scores = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
    return _named(scores @ v).tanh()


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    h = F.layer_norm(x, (x.shape[-1],), weight, bias)
    return _named(F.gelu(h)) * h


def conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = F.conv2d(x, w, padding=1)
    return F.relu(_named(torch.sigmoid(h)) * h)


def dropout(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = F.dropout(torch.tanh(x @ w), p=0.5, training=True)
    return _named(h) * torch.cos(x @ w)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


PROGRAMS: dict[str, tuple[Callable[..., torch.Tensor], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "mlp": (mlp, lambda: (_randn(3, 4), _randn(4, 6), _randn(6, 4))),
    "attention_sdpa": (attention_sdpa, lambda: (_randn(2, 5, 4), _randn(4, 12))),
    "attention_bmm": (attention_bmm, lambda: (_randn(2, 5, 4), _randn(4, 12))),
    "layernorm": (layernorm, lambda: (_randn(3, 6), _randn(6), _randn(6))),
    "conv2d": (conv, lambda: (_randn(1, 2, 5, 5), _randn(3, 2, 3, 3))),
    "dropout": (dropout, lambda: (_randn(3, 4), _randn(4, 4))),
}


ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_script(folder: str, name: str) -> ModuleType:
    """Import ``ROOT/folder/name.py`` (an example or a benchmark) as a module."""
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", ROOT / folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def two_blocks(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Two calls of a block ``f(x, w1, w2)`` with other code before, between and after.

    For ``torch.compile`` tests: takes ``x`` and four weights (`compile_inputs`).
    """

    def run(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        h = f(x.cos(), ws[0], ws[1])
        return f(h * 2, ws[2], ws[3]).exp().sum()

    return run


def compile_inputs() -> list[torch.Tensor]:
    """``x`` (6, 4) and four (4, 4) weights, all requiring grad, seeded."""
    torch.manual_seed(0)
    return [torch.randn(6, 4, requires_grad=True)] + [
        torch.randn(4, 4, requires_grad=True) for _ in range(4)
    ]


def stack(fn: Callable[..., torch.Tensor], n: int) -> Callable[..., torch.Tensor]:
    """``n`` blocks ``fn(x, w1, w2)`` in sequence, taking ``x, *ws`` (two weights a block)."""

    def run(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        for i in range(n):
            x = fn(x, ws[2 * i], ws[2 * i + 1])
        return x

    return run


Fn = Callable[..., Any]


def float_leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()]


def squared_grads(fn: Fn, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    ins = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    torch.manual_seed(0)
    loss = sum(t.pow(2).sum() for t in float_leaves(fn(*ins)))
    assert isinstance(loss, torch.Tensor)
    return torch.autograd.grad(loss, [t for t in ins if t.requires_grad])


def check_remat(fn: Fn, inputs: Sequence[torch.Tensor], policy: str, **options: Any) -> None:
    expected = squared_grads(fn, inputs)
    actual = squared_grads(remat.remat(fn, policy=policy, **options), inputs)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)


def x3() -> torch.Tensor:
    return torch.randn(2, 3, 4)


def w44() -> torch.Tensor:
    return torch.randn(4, 4, requires_grad=True)


F64 = torch.float64


#: Policies that exercise what changed: offload under torch.func, names, save_last.
TORCH_FUNC_POLICIES = (
    "nothing-saveable",
    "dots-saveable",
    "offload-dots",
    "offload:h",
    "offload-dots+save:h",
    "save:h",
    "save-last",
    "save-last+offload-dots",
)


def remat_offloading(
    fn: Callable[..., Any], policy: str, store: FakeHostStore | None = None
) -> Callable[..., Any]:
    return remat.remat(fn, policy=policy, offload_store=store or FakeHostStore(min_bytes=0))


def tree_close(a: Any, b: Any) -> None:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb)
    for p, q in zip(la, lb, strict=True):
        if isinstance(p, torch.Tensor):
            torch.testing.assert_close(q, p, atol=1e-9, rtol=1e-7)
        else:
            assert p == q


def seeded_f64(*shapes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=g, dtype=F64) for s in shapes)


def named_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(x @ w, "h")
    return torch.tanh(h) @ w


def close_or_none(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is not None and b is not None:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


def same_state(ref: nn.Module, got: nn.Module, step: int) -> None:
    r, g = ref.state_dict(), got.state_dict()
    assert list(r) == list(g)
    for key in r:
        close_or_none(g[key], r[key], f"step {step}: state {key}")


def same_grads(ref: nn.Module, got: nn.Module, step: int) -> None:
    for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        close_or_none(q.grad, p.grad, f"step {step}: grad of {name}")


def train_both(
    build: Callable[[], nn.Module],
    prepare: Callable[[nn.Module], nn.Module],
    *,
    steps: int = 3,
    shape: tuple[int, ...] = (6, 4),
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    eval_between: bool = False,
) -> tuple[nn.Module, nn.Module]:
    """Train ``build()`` plain and ``prepare(build())``; compare after every step."""
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    got = prepare(build())
    same_state(ref, got, -1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt_g = torch.optim.SGD(got.parameters(), lr=0.1, momentum=0.9)
    run = call or (lambda m, x: m(x))
    for step in range(steps):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(step))
        for m, opt in ((ref, opt_r), (got, opt_g)):
            opt.zero_grad()
            run(m, x).pow(2).sum().backward()
        same_grads(ref, got, step)
        opt_r.step()
        opt_g.step()
        same_state(ref, got, step)
        if eval_between:
            ref.eval()
            got.eval()
            with torch.no_grad():
                close_or_none(run(got, x), run(ref, x), f"step {step}: eval output")
            ref.train()
            got.train()
            same_state(ref, got, step)
    return ref, got


MODULE_POLICIES = ["nothing-saveable", "save-last", "dots-saveable", "save-last+dots-saveable"]


def batch84() -> torch.Tensor:
    """An (8, 4) float64 batch, seeded."""
    torch.manual_seed(2)
    return torch.randn(8, 4, dtype=torch.double)


# -- memory budgets: a recompute-cost counter and held bytes ---------------------------

#: The budgets the memory-budget tests run (issue #14).
FRACTIONS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)


class RecomputeCost(TorchDispatchMode):
    """Sum the planner's cost estimate over the ops a recompute runs (replayed ops do not run)."""

    def __init__(self) -> None:
        super().__init__()
        self.cost = 0
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        # Dead ops' stand-ins are meta tensors (NOTE [ Record and replay ] rule 5): free.
        stand_in = any(isinstance(t, torch.Tensor) and t.is_meta for t in outs)
        if remat.is_recomputing() and func is not torch.ops.aten.detach.default and not stand_in:
            shapes = [(t.shape, t.dtype) for t in outs if isinstance(t, torch.Tensor)]
            self.cost += op_cost(func, arg_shapes(args, kwargs), shapes)
            self.ops += not func.is_view
        return out


def held_bytes(fn: Callable[..., Any], *args: Any, policy: Any) -> int:
    """Bytes the policy keeps for backward beyond inputs and parameters (saved_residuals)."""
    return remat.residual_totals(remat.saved_residuals(fn, *args, policy=policy))["saved"]


def recompute_cost(step: Callable[..., torch.Tensor], *args: Any) -> RecomputeCost:
    """Run ``step(*args).backward()``, counting what the backward recomputes."""
    loss = step(*args)
    with RecomputeCost() as counter:
        loss.backward()
    return counter


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


#: Shape-preserving steps on a (4, 4) activation `h` with a (4, 4) weight `w`.
STEPS: dict[str, Step] = {
    "matmul": lambda h, w: h @ w,
    "bmm": lambda h, w: torch.bmm(h.unsqueeze(0), w.unsqueeze(0)).squeeze(0),
    "tanh": lambda h, w: torch.tanh(h),
    "sin": lambda h, w: torch.sin(h),
    "mul": lambda h, w: h * w,
    "residual": lambda h, w: h + torch.sigmoid(h @ w),
    "softmax": lambda h, w: torch.softmax(h, dim=-1),
    "layernorm": lambda h, w: F.layer_norm(h, (4,)),
    "dropout": lambda h, w: F.dropout(h, p=0.3, training=True),
    "transpose": lambda h, w: h.t().contiguous(),
    "name_a": lambda h, w: remat.checkpoint_name(h * 1.5, "a"),
    "name_b": lambda h, w: remat.checkpoint_name(torch.cos(h), "b"),
    "relu_inplace": lambda h, w: F.relu(h * 1.0, inplace=True),
}


def step_program(steps: list[str]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A program running the named `STEPS` in order on ``(h, w)``."""
    def run(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        for step in steps:
            h = STEPS[step](h, w)
        return h

    return run


class LoRALinear(nn.Module):
    """A frozen ``Linear`` plus a trainable rank-``rank`` update, as PEFT's LoRA builds it.

    The small matmuls of the update are what make a hand policy such as
    ``dots-saveable`` hold more than no remat at all (the budget tests).
    """

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)  # frozen, as PEFT freezes it
        self.a = nn.Parameter(torch.randn(rank, width) / 4)
        self.b = nn.Parameter(torch.randn(width, rank) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.base(x) + (x @ self.a.t()) @ self.b.t())


def tiny_bert_encoder() -> nn.Module:
    """A two-layer BERT encoder of width 32 without dropout (transformers, random init)."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    encoder: nn.Module = transformers.BertModel(config).encoder
    return encoder


# -- a region with an escape inside another region (the escape tests, per transform) --

#: Where `escape_outer` and `escape_inner` let a tensor out (a global list each).
OUTER_ESCAPES: list[torch.Tensor] = []
INNER_ESCAPES: list[torch.Tensor] = []


def escape_inner(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    g = torch.tanh(h @ w)
    INNER_ESCAPES.append(g)
    return g.sin()


def escape_outer(x: torch.Tensor, w: torch.Tensor,
                 run_inner: Callable[..., torch.Tensor]) -> torch.Tensor:
    h = torch.tanh(x @ w)
    OUTER_ESCAPES.append(h * 1.5)
    return run_inner(h, w).cos()


def nested_escape_loss(run_inner: Callable[..., Any],
                       run_outer: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """A loss reading both escaped tensors: `escape_outer` around `escape_inner`, either remat'd."""
    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        OUTER_ESCAPES.clear()
        INNER_ESCAPES.clear()
        y = run_outer(x, w, run_inner)
        out = y.sum() + (OUTER_ESCAPES[0] ** 2).sum() + 3 * (INNER_ESCAPES[0] ** 2).sum()
        OUTER_ESCAPES.clear()
        INNER_ESCAPES.clear()
        return out

    return loss
