"""The eager engine: gradients equal the no-remat reference, and the policy is obeyed."""

from __future__ import annotations

import collections
import functools
import gc
import weakref

import pytest
import torch
from helpers import (
    CORE_POLICIES,
    POLICIES,
    PROGRAMS,
    Fn,
    OpCounter,
    RecomputeCounter,
    assert_close_all,
    assert_recomputed,
    check_remat,
    grads,
    w44,
    x3,
)

import remat
from remat._state import local


@functools.cache
def _recomputed(program: str, policy: str) -> collections.Counter[str]:
    """The ops the backward of one ``program`` call reruns under ``policy``."""
    fn, make = PROGRAMS[program]
    inputs = make()
    with RecomputeCounter() as counter:
        grads(remat.remat(fn, policy=policy), inputs)
    return counter.counts


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("policy", POLICIES)
def test_grads_match_reference(program: str, policy: str) -> None:
    fn, make = PROGRAMS[program]
    inputs = make()
    expected = grads(fn, inputs)
    with RecomputeCounter() as counter:
        actual = grads(remat.remat(fn, policy=policy), inputs)
    assert_close_all(actual, expected)
    # ...and the policy was obeyed: a remat that recomputed nothing would pass the above.
    assert_recomputed(policy, counter.counts, lambda: _recomputed(program, "nothing-saveable"))


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_backward_accumulates_like_reference(program: str, policy: str) -> None:
    fn, make = PROGRAMS[program]
    inputs = make()
    torch.manual_seed(0)
    fn(*inputs).pow(2).sum().backward()
    expected = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    torch.manual_seed(0)
    remat.remat(fn, policy=policy)(*inputs).pow(2).sum().backward()
    assert_close_all([t.grad for t in inputs], expected)


@pytest.mark.parametrize("program", ["mlp", "attention_bmm", "layernorm", "dropout"])
@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_double_backward_matches_reference(program: str, policy: str) -> None:
    fn, make = PROGRAMS[program]
    inputs = make()

    def second_order(f):  # type: ignore[no-untyped-def]
        first = grads(f, inputs, create_graph=True)
        total = sum((g * g).sum() for g in first)
        return torch.autograd.grad(total, inputs)

    assert_close_all(second_order(remat.remat(fn, policy=policy)), second_order(fn))


def _stack(policy: str, blocks: int = 3):  # type: ignore[no-untyped-def]
    def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
        return torch.sin(h @ w2) + x

    wrapped = remat.remat(block, policy=policy)

    def run(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        for _ in range(blocks):
            x = wrapped(x, w1, w2)
        return x.sum()

    return run


def _backward_ops(policy: str, blocks: int = 3) -> dict[str, int]:
    x = torch.randn(4, 8, requires_grad=True)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    loss = _stack(policy, blocks)(x, w1, w2)
    with OpCounter() as counter:
        loss.backward()
    return dict(counter.counts)


def test_reference_backward_ops() -> None:
    # Without remat the backward runs no forward op: 4 matmuls per block (2 grads x 2 mms).
    ops = _backward_ops("everything-saveable")
    assert ops.get("mm") == 12 and "tanh" not in ops and "sin" not in ops


def test_nothing_saveable_reruns_each_forward_op_once() -> None:
    ops = _backward_ops("nothing-saveable")
    # Each block's ops once; the recompute stops as soon as `sin` has saved its
    # input, so `sin` itself and the residual add never run again.
    assert ops["tanh"] == 3 and ops["mm"] == 12 + 2 * 3 and "sin" not in ops


def test_dots_saveable_reruns_no_matmul() -> None:
    ops = _backward_ops("dots-saveable")
    assert ops["mm"] == 12 and ops["tanh"] == 3 and "sin" not in ops


def test_name_policy_replays_the_named_op() -> None:
    ops = _backward_ops("save:hidden")
    assert "tanh" not in ops  # the named value is replayed, not recomputed
    # ...and the matmul that only fed it is dead: just `h @ w2` runs again.
    assert ops["mm"] == 12 + 3 and ops["empty_strided"] == 3


def test_dead_ops_that_python_reads_or_that_write_through_views_still_run() -> None:
    def f(x, w):  # type: ignore[no-untyped-def]
        h = x @ w
        scale = h.abs().max().item()  # Python reads data: must be real in the recompute
        g = (x @ w) * 2.0
        g[0].mul_(scale)  # writes into g through a view
        return remat.checkpoint_name(torch.sin(g), "s") * g

    x, w = torch.randn(3, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    expected = torch.autograd.grad(f(x, w).sum(), (x, w))
    for policy in ("save:s", "dots-saveable", "save-last+save:s"):
        got = torch.autograd.grad(remat.remat(f, policy=policy)(x, w).sum(), (x, w))
        assert_close_all(got, expected)


def test_everything_except_name_recomputes_only_the_named_op() -> None:
    ops = _backward_ops("everything-except:hidden")
    assert ops["tanh"] == 3 and "sin" not in ops and ops["mm"] == 12


def test_save_last_reruns_every_block_but_the_last() -> None:
    ops = _backward_ops("save-last", blocks=4)
    assert ops["tanh"] == 3 and ops["mm"] == 16 + 2 * 3


def test_save_last_plus_dots_keeps_dots_of_demoted_blocks() -> None:
    ops = _backward_ops("save-last+dots-saveable", blocks=4)
    assert ops["tanh"] == 3 and ops["mm"] == 16


def test_pytrees_kwargs_and_non_tensor_leaves() -> None:
    @remat.remat(policy="dots-saveable")
    def f(inputs, *, scale, tag):  # type: ignore[no-untyped-def]
        x, (w, skip) = inputs["x"], inputs["pair"]
        y = torch.tanh(x @ w) * scale
        return {"y": y, "same": skip, "tag": tag, "none": None, "n": 3}

    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    skip = torch.arange(3)
    out = f({"x": x, "pair": (w, skip)}, scale=2.0, tag="hello")
    assert out["same"] is skip and out["tag"] == "hello" and out["none"] is None and out["n"] == 3
    out["y"].sum().backward()
    expected = torch.autograd.grad((torch.tanh(x @ w) * 2.0).sum(), (x, w))
    assert_close_all([x.grad, w.grad], expected)


def test_static_argnums_and_argnames_select_code_paths() -> None:
    @remat.remat(static_argnums=(1,), static_argnames=("mode",))
    def f(x, power, mode="sin"):  # type: ignore[no-untyped-def]
        y = x**power
        return torch.sin(y) if mode == "sin" else torch.cos(y)

    x = torch.randn(3, requires_grad=True)
    (g,) = torch.autograd.grad(f(x, 3, mode="cos").sum(), x)
    (expected,) = torch.autograd.grad(torch.cos(x**3).sum(), x)
    torch.testing.assert_close(g, expected)


def test_bad_static_args_raise_at_decoration() -> None:
    def f(x, y):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(ValueError, match=r"static_argnums contains 5, but .*f .*takes 2"):
        remat.remat(f, static_argnums=5)
    with pytest.raises(ValueError, match=r"static_argnames contains 'z'"):
        remat.remat(f, static_argnames="z")
    with pytest.raises(TypeError, match="static_argnums must contain only ints"):
        remat.remat(f, static_argnums=("a",))
    with pytest.raises(TypeError, match="expected a callable"):
        remat.remat(3)  # type: ignore[call-overload]


def test_methods_modules_and_decorator_forms() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        @remat.checkpoint(policy="dots-saveable")
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(x))

    block = Block()
    x = torch.randn(2, 4, requires_grad=True)
    block(x).sum().backward()
    got = [x.grad, block.lin.weight.grad]
    x2 = x.detach().requires_grad_()
    ref = torch.autograd.grad(torch.tanh(block.lin(x2)).sum(), (x2, block.lin.weight))
    assert_close_all(got, ref)
    wrapped_module = remat.remat(block.lin)
    assert wrapped_module(x).shape == (2, 4)
    assert remat.remat()(torch.sin)(torch.ones(1)).item() == pytest.approx(0.841470, abs=1e-5)


def test_outputs_may_be_inputs_and_integer_tensors() -> None:
    @remat.remat
    def f(x, idx):  # type: ignore[no-untyped-def]
        return x, idx, torch.sin(x)[idx]

    x, idx = torch.randn(4, requires_grad=True), torch.tensor([0, 2])
    same, same_idx, picked = f(x, idx)
    assert same is x and same_idx is idx
    (g,) = torch.autograd.grad(picked.sum() + same.sum(), x)
    expected = torch.ones(4)
    expected[idx] += torch.cos(x.detach())[idx]
    torch.testing.assert_close(g, expected)


def test_dropout_masks_are_replayed() -> None:
    x = torch.randn(64, requires_grad=True)

    def f(x):  # type: ignore[no-untyped-def]
        return torch.nn.functional.dropout(x.sin(), p=0.5) * x.cos()

    torch.manual_seed(3)
    (expected,) = torch.autograd.grad(f(x).sum(), x)
    torch.manual_seed(3)
    (got,) = torch.autograd.grad(remat.remat(f)(x).sum(), x)
    torch.testing.assert_close(got, expected)


def test_nested_regions_outer_policy_wins() -> None:
    inner = remat.remat(lambda x: torch.sin(torch.sin(x)), policy="nothing-saveable")

    @remat.remat(policy="everything-saveable")
    def outer(x):  # type: ignore[no-untyped-def]
        return inner(x).exp()

    x = torch.randn(5, requires_grad=True)
    out = outer(x).sum()
    with OpCounter() as counter:
        (g,) = torch.autograd.grad(out, x)
    assert "sin" not in counter.counts  # everything kept by the outer region
    (expected,) = torch.autograd.grad(torch.sin(torch.sin(x)).exp().sum(), x)
    torch.testing.assert_close(g, expected)


@pytest.mark.parametrize(
    "inner_policy", ["nothing-saveable", "dots-saveable", "everything-saveable"]
)
@pytest.mark.parametrize("outer_policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_nested_regions_match_reference(inner_policy: str, outer_policy: str) -> None:
    def block(x, w):  # type: ignore[no-untyped-def]
        return torch.tanh(x @ w) * x

    inner = remat.remat(block, policy=inner_policy)

    def body(x, w):  # type: ignore[no-untyped-def]
        return inner(inner(x, w), w).sin()

    x, w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True), torch.randn(
        4, 4, dtype=torch.float64, requires_grad=True
    )
    expected = grads(body, (x, w))
    outer = remat.remat(body, policy=outer_policy)
    assert_close_all(grads(outer, (x, w)), expected)
    assert_close_all(grads(lambda x, w: outer(outer(x, w), w), (x, w)),
                     grads(lambda x, w: body(body(x, w), w), (x, w)))


def test_dead_code_elimination_keeps_the_inputs_of_inner_regions() -> None:
    # The outer recompute replays the named value and would skip the matmul
    # before it, but the inner region recomputes later from its own input.
    inner = remat.remat(lambda h, w: remat.checkpoint_name(h * 1.5, "a").t() @ w)

    def body(h, w):  # type: ignore[no-untyped-def]
        return inner(h @ w, w) @ w

    def plain(h, w):  # type: ignore[no-untyped-def]
        return (((h @ w) * 1.5).t() @ w) @ w

    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    assert_close_all(grads(remat.remat(body, policy="save:a"), (x, w)), grads(plain, (x, w)))


def test_nested_inner_region_recomputes_inside_outer_recompute() -> None:
    calls = []

    def inner_fn(x):  # type: ignore[no-untyped-def]
        calls.append(remat.is_recomputing())
        return torch.sin(x).sin()

    inner = remat.remat(inner_fn)
    outer = remat.remat(lambda x: inner(x).cos())
    x = torch.randn(3, requires_grad=True)
    (g,) = torch.autograd.grad(outer(x).sum(), x)
    # forward (plain, inside outer), outer recompute, inner's own recompute
    assert calls == [False, True, True]
    (expected,) = torch.autograd.grad(torch.sin(x).sin().cos().sum(), x)
    torch.testing.assert_close(g, expected)


def test_is_recomputing_guards_side_effects() -> None:
    seen = []

    @remat.remat
    def f(x):  # type: ignore[no-untyped-def]
        seen.append(remat.is_recomputing())
        return x.sin().sin()

    f(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False, True] and not remat.is_recomputing()


def test_no_grad_runs_plainly_once() -> None:
    calls = []

    @remat.remat
    def f(x):  # type: ignore[no-untyped-def]
        calls.append(1)
        return x.sin()

    with torch.no_grad():
        out = f(torch.ones(2, requires_grad=True))
    assert out.grad_fn is None and calls == [1]


def test_second_backward_without_retain_graph_fails_clearly() -> None:
    x = torch.randn(3, requires_grad=True)
    out = remat.remat(lambda x: x.sin().sin())(x).sum()
    out.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward()


def test_second_backward_with_retain_graph_works() -> None:
    x = torch.randn(3, requires_grad=True)
    out = remat.remat(lambda x: x.sin().sin())(x).sum()
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    torch.testing.assert_close(x.grad, 2 * first)


def test_nondeterministic_shapes_raise_naming_the_region() -> None:
    calls = []

    def flaky(x):  # type: ignore[no-untyped-def]
        calls.append(1)
        n = 3 if len(calls) == 1 else 2
        return x[:n].sin().sin()

    x = torch.randn(4, requires_grad=True)
    out = remat.remat(flaky)(x).sum()
    pattern = r"recompute of .*flaky .*test_eager.py:\d+\) differs"
    with pytest.raises(remat.RematError, match=pattern):
        out.backward()


def test_nondeterministic_ops_raise_naming_the_first_differing_op() -> None:
    calls = []

    def flaky(x):  # type: ignore[no-untyped-def]
        calls.append(1)
        y = x.sin() if len(calls) == 1 else x.cos()
        return (y @ x).tanh().sum()

    x = torch.randn(3, 3, requires_grad=True)
    out = remat.remat(flaky, policy="dots-saveable")(x)
    with pytest.raises(remat.NondeterministicRecomputeError) as info:
        out.backward()
    message = str(info.value)
    assert "the forward ran aten.sin.default, the recompute ran aten.cos.default" in message
    assert "-> " in message  # the side-by-side log marks the first difference


@pytest.mark.parametrize("engine", ["eager", "functional"])
def test_replay_compares_ops_even_without_the_determinism_check(engine: str) -> None:
    calls = []

    def flaky(x, w):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            return (x @ w).sin().sin()
        return (x.cos() @ w).sin().sin()  # op #0 differs: the kept `x @ w` must not stand in

    x, w = torch.randn(3, 3), torch.randn(3, 3, requires_grad=True)
    f = remat.remat(flaky, policy="dots-saveable", determinism_check=False, engine=engine)
    if engine == "functional":
        with pytest.raises(remat.NondeterministicRecomputeError, match=r"aten\.cos"):
            torch.func.grad(lambda w: f(x, w).sum())(w)
        return
    out = f(x, w).sum()
    with pytest.raises(remat.NondeterministicRecomputeError, match=r"aten\.cos"):
        out.backward()


def test_debug_mode_prints_op_logs_for_opless_policies() -> None:
    calls = []

    def flaky(x):  # type: ignore[no-untyped-def]
        calls.append(1)
        return (x.sin() if len(calls) == 1 else x.cos()).sin()

    x = torch.randn(3, requires_grad=True)
    out = remat.remat(flaky, debug=True)(x).sum()
    with pytest.raises(remat.RematError, match=r"aten\.sin\.default.*aten\.cos\.default"):
        out.backward()


def test_input_mutated_between_forward_and_backward_raises() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x * 1.0
    out = remat.remat(lambda y: y.sin().sin())(y).sum()
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(remat.SavedInputMutatedError, match="was modified in place after"):
        out.backward()


def test_exception_inside_fn_leaves_no_state_behind() -> None:
    from remat._state import local

    def broken(x):  # type: ignore[no-untyped-def]
        x.sin()
        raise KeyError("boom")

    for policy in ("nothing-saveable", "dots-saveable", "save-last"):
        with pytest.raises(KeyError):
            remat.remat(broken, policy=policy)(torch.ones(2, requires_grad=True))
        assert local.frames == [] and local.recorders == []
        assert torch._C._len_torch_dispatch_stack() == 0
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    x = torch.ones(2, requires_grad=True)
    remat.remat(lambda x: x.sin().sin())(x).sum().backward()
    assert x.grad is not None


def test_region_state_is_freed_after_backward() -> None:
    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sin().sin()

    block = Block()
    ref = weakref.ref(block)
    x = torch.ones(3, requires_grad=True)
    remat.remat(block, policy="dots-saveable")(x).sum().backward()
    del block
    gc.collect()
    assert ref() is None


def test_policy_errors_surface_at_decoration() -> None:
    with pytest.raises(ValueError, match="did you mean 'dots-saveable'"):
        remat.remat(torch.sin, policy="dots-savable")
    with pytest.raises(ValueError, match="engine must be one of"):
        remat.remat(torch.sin, engine="jit")  # type: ignore[arg-type]


def test_autocast_state_is_replayed() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def f(x, w):  # type: ignore[no-untyped-def]
        return (x @ w).float().sin()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = remat.remat(f)(x, w).sum()
    got = torch.autograd.grad(out, (x, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = f(x, w).sum()
    expected = torch.autograd.grad(out, (x, w))
    assert_close_all(got, expected)


@pytest.mark.parametrize("policy", ["dots-saveable", "save:attn"])
def test_attention_kernel_is_not_recomputed_when_kept(policy: str) -> None:
    # SDPA kernels are tagged random (dropout_p); with dropout_p == 0 they draw
    # nothing and may be kept; naming their output keeps the log-sum-exp too.
    def f(x, w):  # type: ignore[no-untyped-def]
        q, k, v = (x @ w).reshape(2, 5, 3, 4).unbind(2)
        attn = remat.checkpoint_name(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), "attn"
        )
        return torch.tanh(attn @ w[:, :4])

    x, w = torch.randn(2, 5, 4, requires_grad=True), torch.randn(4, 12, requires_grad=True)
    expected = torch.autograd.grad(f(x, w).sum(), (x, w))
    out = remat.remat(f, policy=policy)(x, w).sum()
    with OpCounter() as counter:
        got = torch.autograd.grad(out, (x, w))
    assert not any("scaled_dot_product" in op and "backward" not in op for op in counter.counts)
    assert_close_all(got, expected)


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_function_that_differentiates_inside_the_region(policy: str) -> None:
    # An inner gradient (a score, a force) taken inside the region: its backward
    # unpacks the region's own saved tensors during the forward and during the
    # recompute, and the recording mode must not see that recompute's ops.
    def f(x, w):  # type: ignore[no-untyped-def]
        y = remat.checkpoint_name((x @ w).tanh(), "hidden")
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return (g * y).sin()

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    expected = torch.autograd.grad(f(x, w).sum(), (x, w))
    assert_close_all(torch.autograd.grad(remat.remat(f, policy=policy)(x, w).sum(), (x, w)),
                     expected)


def test_python_numbers_that_change_before_the_recompute_raise() -> None:
    state = {"scale": 1.0}

    def f(x):  # type: ignore[no-untyped-def]
        y = x * state["scale"]
        state["scale"] += 1.0  # Python state the recompute would read differently
        return y.sin()

    out = remat.remat(f, policy="dots-saveable")(torch.randn(3, requires_grad=True)).sum()
    with pytest.raises(remat.NondeterministicRecomputeError, match=r"got the numbers \(1\.0,\) in "
                       r"the forward and \(2\.0,\) in the recompute"):
        out.backward()


def _item_control_flow(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w
    scale = h.exp().sum().item()
    if h.sum() > 0:
        return (h * scale).sin()
    return (h * scale).cos()


def _no_grad_inside(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        s = (x @ w).abs().amax()
    return ((x @ w) / s).sin()


def _inplace_on_real_views(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x.reshape(-1, 4) @ w
    y[0].mul_(3)
    y.t()[1].add_(1)
    torch.ops.aten.alias(y).mul_(2)
    y.as_strided((3, 4), (4, 1)).add_(1)
    y.detach().mul_(2)
    return y.sin()


def _multi_output(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w
    v, _ = h.max(dim=-1)
    v = remat.checkpoint_name(v, "v")
    a, b = h.chunk(2, dim=-1)
    m, s = torch.var_mean(h, dim=-1)
    s = remat.checkpoint_name(s, "s")
    return (v.sin() * m.cos() * s).unsqueeze(-1) + (a * b).tanh()


def _names_on_odd_things(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    remat.checkpoint_name(x, "n")
    remat.checkpoint_name(w, "n")
    remat.checkpoint_name({"a": 3, "b": "s", "c": None}, "n")
    v = remat.checkpoint_name(w.t(), "n")
    h = remat.checkpoint_name((x @ v).sin(), "n")
    return (h @ w).tanh()


def _autocast_inside(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = (x @ w).relu()
    return (h.float() @ w).sin()


def _nested_three_deep(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    inner = remat.remat(lambda y: (y @ w).sin() @ w, policy="nothing-saveable")
    mid = remat.remat(lambda y: inner(y.tanh() * 2).cos() @ w, policy="dots-saveable")
    t = x.exp()  # read only by the nested regions
    return mid(t).exp() @ w + (x @ w).sin()


PROBES: dict[str, tuple[Fn, tuple[str, ...]]] = {
    "item_control_flow": (_item_control_flow, ("nothing-saveable", "dots-saveable")),
    "no_grad_inside": (_no_grad_inside, ("nothing-saveable", "dots-saveable")),
    "inplace_on_real_views": (_inplace_on_real_views, ("dots-saveable", "save-last+dots-saveable")),
    "multi_output": (
        _multi_output,
        ("save:v,s", "save:s", "save-except:v", "everything-except:s", "dots-saveable"),
    ),
    "names_on_odd_things": (
        _names_on_odd_things,
        ("save:n", "save-except:n", "everything-except:n", "offload:n"),
    ),
    "autocast_inside": (_autocast_inside, ("nothing-saveable", "dots-saveable", "save-last")),
    "nested_three_deep": (
        _nested_three_deep,
        ("nothing-saveable", "dots-saveable", "save-last", "save-except:q", "everything-saveable"),
    ),
}


@pytest.mark.parametrize(
    ("probe", "policy"), [(name, p) for name, (_, ps) in PROBES.items() for p in ps]
)
def test_probe_matches_reference(probe: str, policy: str) -> None:
    fn, _ = PROBES[probe]
    check_remat(fn, [x3(), w44()], policy)


def test_exception_mid_recompute_leaves_clean_state() -> None:
    boom = [True]

    def flaky(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = (x @ w).sin()
        if remat.is_recomputing() and boom[0]:
            raise ValueError("boom")
        return (h @ w).cos()

    f = remat.remat(flaky, policy="dots-saveable")
    x, w = x3(), w44()
    with pytest.raises(ValueError, match="boom"):
        f(x, w).sum().backward()
    assert not local.frames and not local.recorders and local.recompute_depth == 0
    boom[0] = False
    w.grad = None
    f(x, w).sum().backward()
    assert w.grad is not None
    (reference,) = torch.autograd.grad(flaky(x, w).sum(), w)
    torch.testing.assert_close(w.grad, reference)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save:h", "save-last"])
def test_except_exception_in_the_region_does_not_swallow_the_early_stop(policy: str) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(x @ w, "h")
        try:
            y = h.sin() * h.tanh()
        except Exception:  # a user's fallback path
            y = torch.sin(h).mul(torch.tanh(h))
        return y

    x = torch.randn(3, 3, dtype=torch.double, requires_grad=True)
    w = torch.randn(3, 3, dtype=torch.double, requires_grad=True)
    expected = torch.autograd.grad(f(x, w).sum(), (x, w))
    actual = torch.autograd.grad(remat.remat(f, policy=policy)(x, w).sum(), (x, w))
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)
