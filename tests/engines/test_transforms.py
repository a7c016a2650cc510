"""Adversarial probes of the torch.func engine: `remat(fn)` must differentiate exactly like `fn`.

Every test compares a rematerialized program with the same program without
remat, in float64, under torch.func transforms (and eager autograd mixed in).
Offload policies run with a `FakeHostStore(min_bytes=0)`, so every offloaded
value really goes through the store on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, vjp, vmap

import remat
from remat._offload.fake import FakeHostStore

D = torch.float64

#: Policies that exercise what changed: offload under torch.func, names, save_last.
POLICIES = (
    "nothing-saveable",
    "dots-saveable",
    "offload-dots",
    "offload:h",
    "offload-dots+save:h",
    "save:h",
    "save-last",
    "save-last+offload-dots",
)

TRANSFORMS = ("grad", "vjp2", "jacrev", "jacfwd", "vmap_grad", "grad_grad", "hessian", "eager")


def _r(
    fn: Callable[..., Any], policy: str, store: FakeHostStore | None = None
) -> Callable[..., Any]:
    return remat.remat(fn, policy=policy, offload_store=store or FakeHostStore(min_bytes=0))


def _close(a: Any, b: Any) -> None:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb)
    for p, q in zip(la, lb, strict=True):
        if isinstance(p, torch.Tensor):
            torch.testing.assert_close(q, p, atol=1e-9, rtol=1e-7)
        else:
            assert p == q


def _gen(*shapes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=g, dtype=D) for s in shapes)


# -- regions: 2-D/3-D linear, einsum, conv, sdpa ------------------------------------


def _lin2(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(x @ w + b, "h")
    return (torch.tanh(h) @ w.T).sin()


def _lin3(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(F.linear(x, w, b), "h")
    return F.gelu(torch.einsum("bij,jk->bik", torch.tanh(h), w))


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(F.conv2d(x, w, b, padding=1), "h")
    return torch.tanh(h).square()


def _sdpa(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    q = remat.checkpoint_name(x @ w, "h")
    return (F.scaled_dot_product_attention(q, x, x) * b).tanh()


REGIONS: dict[str, tuple[Callable[..., torch.Tensor], tuple[tuple[int, ...], ...]]] = {
    "lin2": (_lin2, ((4, 5), (5, 5), (5,))),
    "lin3": (_lin3, ((2, 3, 5), (5, 5), (5,))),
    "conv": (_conv, ((1, 2, 4, 4), (2, 2, 3, 3), (2,))),
    "sdpa": (_sdpa, ((2, 3, 5), (5, 5), (5,))),
}


def _apply(transform: str, f: Callable[..., torch.Tensor], x: Any, w: Any, b: Any) -> Any:
    def loss(x: Any, w: Any, b: Any) -> torch.Tensor:
        return f(x, w, b).pow(2).sum()

    if transform == "grad":
        return grad(loss, argnums=(0, 1, 2))(x, w, b)
    if transform == "vjp2":  # the same vjp_fn twice, different cotangents
        out, fn = vjp(f, x, w, b)
        return out, fn(torch.ones_like(out)), fn(out.detach().cos())
    if transform == "jacrev":
        return jacrev(f, argnums=(1, 2))(x, w, b)
    if transform == "jacfwd":
        return jacfwd(f, argnums=2)(x, w, b)
    if transform == "vmap_grad":
        return vmap(grad(loss, argnums=(1, 2)), in_dims=(0, None, None))(
            torch.stack([x, 2 * x]), w, b
        )
    if transform == "grad_grad":
        return grad(lambda x, w, b: grad(loss, argnums=1)(x, w, b).sin().sum(), argnums=(0, 1, 2))(
            x, w, b
        )
    if transform == "hessian":
        return hessian(loss, argnums=2)(x, w, b)
    assert transform == "eager"
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss(*leaves).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("region", sorted(REGIONS))
def test_regions_under_transforms_all_policies(region: str, transform: str) -> None:
    fn, shapes = REGIONS[region]
    x, w, b = _gen(*shapes)
    expected = _apply(transform, fn, x, w, b)
    for policy in POLICIES:
        store = FakeHostStore(min_bytes=0)
        _close(expected, _apply(transform, _r(fn, policy, store), x, w, b))


# -- vjp_fns called late, twice, interleaved with other regions ---------------------


def _blk(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(x @ w, "h")
    return torch.tanh(h) @ w


@pytest.mark.parametrize("policy", POLICIES)
def test_vjp_fns_interleaved_with_other_regions_sharing_a_store(policy: str) -> None:
    x, w = _gen((4, 5), (5, 5))

    def program(f1: Callable[..., Any], f2: Callable[..., Any]) -> Any:
        o1, fn1 = vjp(f1, x, w)
        o2, fn2 = vjp(f2, o1.detach() * 1.5, w)
        g2 = fn2(torch.ones_like(o2))
        g1 = fn1(torch.ones_like(o1))
        return g1, g2, fn2(2 * torch.ones_like(o2)), fn1(3 * torch.ones_like(o1))

    store = FakeHostStore(min_bytes=0)
    _close(program(_blk, _blk), program(_r(_blk, policy, store), _r(_blk, policy, store)))


# -- outputs: partially unused, views of inputs, the inputs, ints, non-tensors ------


def _multi(x: torch.Tensor, w: torch.Tensor) -> dict[str, Any]:
    h = remat.checkpoint_name(x @ w, "h")
    a = torch.tanh(h)
    return {
        "a": a,
        "view": x[1:],
        "t": x.t(),
        "count": (h > 0).long().sum(),
        "argmax": h.argmax(-1),
        "same": x,
        "n": 3,
        "b": (a @ w).sin(),
    }


def _multi_loss(f: Callable[..., dict[str, Any]]) -> Callable[..., torch.Tensor]:
    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        o = f(x, w)
        assert o["n"] == 3 and o["count"].dtype == torch.long
        return 2 * o["view"].sum() + o["t"].pow(2).sum() + o["same"].sum() + o["a"].sum()

    return loss


@pytest.mark.parametrize("policy", POLICIES)
def test_views_ints_and_unused_outputs(policy: str) -> None:
    x, w = _gen((4, 5), (5, 5))
    for t in (
        lambda f: grad(_multi_loss(f), argnums=(0, 1))(x, w),
        lambda f: jacfwd(_multi_loss(f), argnums=(0, 1))(x, w),
        lambda f: hessian(_multi_loss(f), argnums=1)(x, w),
        lambda f: vmap(grad(_multi_loss(f), argnums=1), in_dims=(0, None))(torch.stack([x, -x]), w),
    ):
        _close(t(_multi), t(_r(_multi, policy)))


# -- nesting ------------------------------------------------------------------------


@pytest.mark.parametrize("outer", POLICIES)
@pytest.mark.parametrize("inner", ["nothing-saveable", "offload-dots", "save-last"])
def test_functional_inside_functional(outer: str, inner: str) -> None:
    x, w = _gen((4, 5), (5, 5))
    inner_fn = _r(_blk, inner)

    def ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (_blk(x, w).cos() * _blk(x, w)).pow(2).sum()

    got_region = remat.remat(
        lambda x, w: inner_fn(x, w).cos() * _blk(x, w),
        policy=outer,
        offload_store=FakeHostStore(min_bytes=0),
        engine="functional",
    )

    def got(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return got_region(x, w).pow(2).sum()

    _close(grad(ref, argnums=(0, 1))(x, w), grad(got, argnums=(0, 1))(x, w))
    _close(
        grad(lambda x, w: grad(ref, argnums=1)(x, w).sum())(x, w),
        grad(lambda x, w: grad(got, argnums=1)(x, w).sum())(x, w),
    )
    _close(jacfwd(ref, argnums=1)(x, w), jacfwd(got, argnums=1)(x, w))


def test_eager_engine_forced_inside_grad_raises_not_zero() -> None:
    x, w = _gen((4, 5), (5, 5))
    f = remat.remat(_blk, engine="eager")
    with pytest.raises(remat.RematError, match=r"engine='eager' inside a torch\.func transform"):
        grad(lambda x, w: f(x, w).sum(), argnums=1)(x, w)


# -- the same region twice, save_last stacks of mixed policies ----------------------


@pytest.mark.parametrize("first", POLICIES)
def test_same_region_twice_and_mixed_stacks(first: str) -> None:
    x, w = _gen((4, 5), (5, 5))

    def program(f1: Callable[..., Any], f2: Callable[..., Any]) -> Callable[..., torch.Tensor]:
        return lambda x, w: f2(f1(f1(x, w).sin(), w), w).pow(2).sum() + f1(x, 2 * w).sum()

    for second in ("save-last", "offload-dots", "save-last+offload-dots"):
        f1, f2 = _r(_blk, first), _r(_blk, second)
        _close(
            grad(program(_blk, _blk), argnums=(0, 1))(x, w),
            grad(program(f1, f2), argnums=(0, 1))(x, w),
        )
        _close(
            vmap(grad(program(_blk, _blk), argnums=1), in_dims=(0, None))(torch.stack([x, -x]), w),
            vmap(grad(program(f1, f2), argnums=1), in_dims=(0, None))(torch.stack([x, -x]), w),
        )
        _close(
            hessian(program(_blk, _blk), argnums=0)(x[:2], w),
            hessian(program(f1, f2), argnums=0)(x[:2], w),
        )


# -- checkpoint_name on inputs and views, under vmap --------------------------------


def _named_inputs(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xi = remat.checkpoint_name(x, "h")
    v = remat.checkpoint_name(xi[..., 1:], "h")
    wt = remat.checkpoint_name(w.T, "h")
    return torch.tanh(x @ wt).sum() + v.sin().sum()


@pytest.mark.parametrize("policy", POLICIES)
def test_checkpoint_name_on_inputs_and_views_under_vmap(policy: str) -> None:
    x, w = _gen((4, 5), (5, 5))
    xs = torch.stack([x, -x])
    f = _r(_named_inputs, policy)
    _close(
        vmap(grad(_named_inputs, argnums=(0, 1)), in_dims=(0, None))(xs, w),
        vmap(grad(f, argnums=(0, 1)), in_dims=(0, None))(xs, w),
    )
    _close(
        jacrev(vmap(_named_inputs, in_dims=(0, None)), argnums=1)(xs, w),
        jacrev(vmap(f, in_dims=(0, None)), argnums=1)(xs, w),
    )


# -- dropout under vmap -------------------------------------------------------------


def _drop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(x @ w, "h")
    return F.dropout(torch.tanh(h), 0.5, training=True) @ w


@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_under_vmap(policy: str, randomness: str) -> None:
    x, w = _gen((4, 5), (5, 5))
    xs = torch.stack([x, -x, x])

    def vmap_of_grad(f: Callable[..., Any]) -> Any:
        torch.manual_seed(3)
        g = grad(lambda x, w: f(x, w).pow(2).sum(), argnums=(0, 1))
        return vmap(g, in_dims=(0, None), randomness=randomness)(xs, w)

    def grad_of_vmap(f: Callable[..., Any]) -> Any:
        torch.manual_seed(3)
        return grad(
            lambda x, w: vmap(f, in_dims=(0, None), randomness=randomness)(x, w).pow(2).sum(),
            argnums=(0, 1),
        )(xs, w)

    f = _r(_drop, policy)
    _close(vmap_of_grad(_drop), vmap_of_grad(f))
    _close(grad_of_vmap(_drop), grad_of_vmap(f))


# -- modules with buffers through functional_call -----------------------------------


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5).double()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(remat.checkpoint_name(self.lin(x), "h") * self.scale) @ self.lin.weight


@pytest.mark.parametrize("policy", POLICIES)
def test_functional_call_with_swapped_buffers(policy: str) -> None:
    torch.manual_seed(0)
    (x,) = _gen((4, 5))
    plain = _Scaled()
    wrapped = _Scaled()
    wrapped.load_state_dict(plain.state_dict())
    remat.wrap(wrapped, policy=policy)
    params = {k: v.detach() for k, v in plain.named_parameters()}
    buffers = {"scale": torch.linspace(-1.0, 2.0, 5, dtype=D)}  # differs from the module's

    def loss(module: nn.Module) -> Callable[..., torch.Tensor]:
        return lambda p, bufs, x: functional_call(module, (p, bufs), (x,)).pow(2).sum()

    _close(
        grad(loss(plain), argnums=(0, 1))(params, buffers, x),
        grad(loss(wrapped), argnums=(0, 1))(params, buffers, x),
    )
    _close(
        jacrev(loss(plain), argnums=0)(params, buffers, x),
        jacrev(loss(wrapped), argnums=0)(params, buffers, x),
    )


# -- eager autograd and torch.func in one program -----------------------------------


def _blk_unnamed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) @ w


def _eager_through_vjp(f: Callable[..., torch.Tensor]) -> torch.Tensor:
    x, w = _gen((4, 5), (5, 5))
    w = w.requires_grad_()
    out, fn = vjp(f, x, w)
    _, gw = fn(torch.ones_like(out))
    (gw.pow(2).sum() + out.sum()).backward()
    assert w.grad is not None
    return w.grad


def _eager_and_func(f: Callable[..., torch.Tensor]) -> Any:
    x, w = _gen((4, 5), (5, 5))
    w = w.requires_grad_()
    y = f(x, w)  # an eager region
    g = grad(lambda x, w: f(x, w).sum(), argnums=1)(y.detach(), w)
    (y.pow(2).sum() + (g * w).sum()).backward()
    return w.grad, g


def _create_graph(f: Callable[..., torch.Tensor]) -> Any:
    x, w = _gen((4, 5), (5, 5))
    w = w.requires_grad_()
    (g,) = torch.autograd.grad(f(x, w).pow(2).sum(), w, create_graph=True)
    g.sin().sum().backward()
    return w.grad


@pytest.mark.parametrize("policy", POLICIES)
def test_eager_and_torch_func_mixed_unnamed_region(policy: str) -> None:
    _close(_eager_through_vjp(_blk_unnamed), _eager_through_vjp(_r(_blk_unnamed, policy)))
    _close(_eager_and_func(_blk_unnamed), _eager_and_func(_r(_blk_unnamed, policy)))
    forced = remat.remat(_blk_unnamed, policy=policy, engine="functional")
    _close(_create_graph(_blk_unnamed), _create_graph(forced))


@pytest.mark.parametrize("policy", ["nothing-saveable", "offload-dots", "offload:h"])
def test_eager_and_torch_func_mixed_named_region_recompute_or_offload(policy: str) -> None:
    _close(_eager_through_vjp(_blk), _eager_through_vjp(_r(_blk, policy)))
    _close(_eager_and_func(_blk), _eager_and_func(_r(_blk, policy)))


_NAMED_KEPT_BUG = (
    "bug: OpLog.name keeps a checkpoint_name'd value by detaching it from Python while the "
    "recorded forward's inner torch.func.vjp level is live, so the kept alias is a "
    "GradTrackingTensor of that level (dead after the forward); replay returns it and eager "
    "autograd above the torch.func engine loses the path through it: second-order eager "
    "gradients are silently wrong"
)


@pytest.mark.parametrize("policy", ["dots-saveable", "save:h", "offload-dots+save:h", "save-last"])
def test_eager_backward_of_vjp_fn_output_with_named_kept_value(policy: str) -> None:
    _close(_eager_through_vjp(_blk), _eager_through_vjp(_r(_blk, policy)))


@pytest.mark.parametrize("policy", ["dots-saveable", "save:h", "save-last"])
def test_eager_backward_through_torch_func_grad_with_named_kept_value(policy: str) -> None:
    _close(_eager_and_func(_blk), _eager_and_func(_r(_blk, policy)))


@pytest.mark.parametrize("policy", ["dots-saveable", "save:h"])
def test_create_graph_through_functional_engine_with_named_kept_value(policy: str) -> None:
    forced = remat.remat(_blk, policy=policy, engine="functional")
    _close(_create_graph(_blk), _create_graph(forced))


def test_named_kept_value_is_a_plain_tensor() -> None:
    """The root cause, directly: what a record keeps must carry no functorch level."""
    from remat._engines import functional as engine

    calls: list[Any] = []
    original = engine._Call.forward

    def spy(self: Any, tensors: Any) -> Any:
        calls.append(self)
        return original(self, tensors)

    x, w = _gen((4, 5), (5, 5))
    engine._Call.forward = spy  # type: ignore[method-assign]
    try:
        vjp(remat.remat(_blk, policy="save:h"), x, w.requires_grad_())
    finally:
        engine._Call.forward = original  # type: ignore[method-assign]
    kept = calls[0].log.records[0].kept[0]
    assert not torch._C._functorch.is_functorch_wrapped_tensor(kept)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save:h", "save-last"])
def test_region_that_runs_torch_func_grad_inside_under_grad(policy: str) -> None:
    # An inner torch.func.grad (a score) inside a region differentiated by an outer grad.
    w = torch.randn(4, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w), "h")
        g = grad(lambda v: (v @ w).sin().sum())(h)
        return (g * h).sum()

    _close(grad(remat.remat(f, policy=policy), argnums=1)(x, w), grad(f, argnums=1)(x, w))


# -- nested forward mode (found by review: tangents of tangents came out zero) ----


def _second_order_forward(kind: str, f: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    ones = torch.ones(4, dtype=D)
    if kind == "jvp_jvp":
        return lambda w: torch.func.jvp(
            lambda v: torch.func.jvp(f, (v,), (ones,))[1], (w,), (ones,)
        )
    if kind == "jacfwd_jacfwd":
        return jacfwd(jacfwd(f))
    if kind == "jacfwd_jvp":
        return jacfwd(lambda w: torch.func.jvp(f, (w,), (ones,))[1])
    assert kind == "grad_jvp_jvp"  # a reverse level around them: still exact
    second = _second_order_forward("jvp_jvp", f)
    return grad(lambda w: second(w)[1])


@pytest.mark.parametrize("kind", ["jvp_jvp", "jacfwd_jacfwd", "jacfwd_jvp", "grad_jvp_jvp"])
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_nested_forward_mode(kind: str, policy: str) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(4, dtype=D), torch.randn(4, dtype=D)

    def f(h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.sin(h * v).sum() * torch.cos(h @ v)

    region = remat.remat(f, policy=policy)
    expected = _second_order_forward(kind, lambda v: f(x, v))(w)
    actual = _second_order_forward(kind, lambda v: region(x, v))(w)
    optree.tree_map(torch.testing.assert_close, actual, expected)
    assert all(bool(t.abs().sum() > 0) for t in optree.tree_leaves(expected))  # not zero anyway


# -- random regions whose backward runs under a new vmap (found by review) ----------


def _dropout_region(policy: str) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    def f(h: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.sin(h), 0.5, training=True) * 2

    return f, remat.remat(f, policy=policy)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
@pytest.mark.parametrize("randomness", ["different", "error"])
def test_random_region_backward_under_a_new_vmap_raises(policy: str, randomness: str) -> None:
    _, g = _dropout_region(policy)
    x = torch.randn(6, dtype=D)
    _, vjp_fn = vjp(g, x)
    with pytest.raises(remat.RematError, match="draws random numbers"):
        vmap(vjp_fn, randomness=randomness)(torch.eye(6, dtype=D))
    with pytest.raises(remat.RematError, match="draws random numbers"):
        jacrev(g)(x)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_random_region_backward_under_vmap_same_randomness(policy: str) -> None:
    f, g = _dropout_region(policy)
    x = torch.randn(6, dtype=D)
    torch.manual_seed(0)
    _, expected_fn = vjp(f, x)
    torch.manual_seed(0)
    _, vjp_fn = vjp(g, x)
    eye = torch.eye(6, dtype=D)
    torch.testing.assert_close(
        vmap(vjp_fn, randomness="same")(eye), vmap(expected_fn, randomness="same")(eye)
    )


def test_random_eager_region_with_vmapped_autograd_grad_raises() -> None:
    _, g = _dropout_region("nothing-saveable")
    x = torch.randn(6, dtype=D, requires_grad=True)
    out = g(x)

    def row(v: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(out, x, v, retain_graph=True)[0]

    with pytest.raises(remat.RematError, match="draws random numbers"):
        vmap(row, randomness="different")(torch.eye(6, dtype=D))


def test_deterministic_region_backward_under_a_new_vmap_still_runs() -> None:
    g = remat.remat(lambda h: torch.sin(h) * h)
    x = torch.randn(6, dtype=D)
    torch.testing.assert_close(jacrev(g)(x), jacrev(lambda h: torch.sin(h) * h)(x))


# linearize traces its jvp with zero tensors, which have no storage (found by review).
@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node")  # torch's const folding
@pytest.mark.parametrize(
    "policy", ["everything-except:a", "save-last", "dots-saveable", "offload-dots", "save:a"]
)
def test_linearize(policy: str) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(3, 4, dtype=D), torch.randn(4, 4, dtype=D)

    def f(h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.sin(remat.checkpoint_name(h @ v, "a")).sum(-1)

    region = remat.remat(f, policy=policy)
    with remat.use_host_store(FakeHostStore(min_bytes=0)):
        out, jvp_fn = torch.func.linearize(lambda v: region(x, v), w)
    expected_out, expected_fn = torch.func.linearize(lambda v: f(x, v), w)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(jvp_fn(w.cos()), expected_fn(w.cos()))
