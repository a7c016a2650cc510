"""`remat.compat`: torch's checkpoint signatures on remat's engines.

Each case runs the same call through ``torch.utils.checkpoint`` (non-reentrant)
and `remat.compat`, and compares outputs, gradients and the ops the backward
recomputed; under ``torch.func`` (where torch's raises) it compares against the
function without checkpointing.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc
from helpers import OpCounter
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import remat
import remat.compat

POLICIES = ("nothing-saveable", "dots-saveable", "everything-saveable", "save-last")
DOTS = ("mm", "addmm")


def _block(dropout: float = 0.25) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.GELU(), nn.Dropout(dropout), nn.Linear(16, 6), nn.Tanh()
    )


def _run(checkpoint: Any, block: Any, x: torch.Tensor, params: Any = None,
         **options: Any) -> dict[str, Any]:
    """Output, gradients (input and ``params``, default the block's) and backward op counts."""
    x = x.detach().requires_grad_()
    torch.manual_seed(7)
    out = checkpoint(block, x, **options)
    inputs = [x, *(block.parameters() if params is None else params)]
    with OpCounter() as counter:
        grads = torch.autograd.grad((out * out).sum(), inputs)
    return {"out": out.detach(), "grads": grads, "counts": counter.counts}


def _plain(block: nn.Module, x: torch.Tensor, **_: Any) -> torch.Tensor:
    return block(x)  # type: ignore[no-any-return]


def _dots(counts: Any) -> int:
    return sum(counts[op] for op in DOTS)


@pytest.mark.parametrize("use_reentrant", [False, True, None])
@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_equals_torch_checkpoint_with_dropout(use_reentrant: bool | None,
                                              preserve_rng_state: bool) -> None:
    block, x = _block(), torch.randn(4, 6)
    options = {"preserve_rng_state": preserve_rng_state}
    ours = _run(remat.compat.checkpoint, block, x, use_reentrant=use_reentrant, **options)
    torch_ = _run(tc.checkpoint, block, x, use_reentrant=False, **options)
    plain = _run(_plain, block, x)
    if preserve_rng_state:  # the recompute replays the forward's dropout mask
        torch.testing.assert_close(ours["grads"], plain["grads"])
    torch.testing.assert_close(ours["out"], torch_["out"])
    torch.testing.assert_close(ours["out"], plain["out"])
    torch.testing.assert_close(ours["grads"], torch_["grads"])
    # Both recompute the two Linear layers in backward: 2 forward + 4 backward matmuls.
    assert _dots(ours["counts"]) == _dots(torch_["counts"]) == 6
    assert _dots(plain["counts"]) == 4


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_keyword(policy: str) -> None:
    block, x = _block(0.0), torch.randn(4, 6)
    ours = _run(remat.compat.checkpoint, block, x, use_reentrant=False, policy=policy)
    plain = _run(_plain, block, x)
    torch.testing.assert_close(ours["grads"], plain["grads"])
    recomputed = _dots(ours["counts"]) - _dots(plain["counts"])
    assert recomputed == (2 if policy == "nothing-saveable" else 0)


def _policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> tc.CheckpointPolicy:
    if op in (torch.ops.aten.addmm.default, torch.ops.aten.gelu.default):
        return tc.CheckpointPolicy.MUST_SAVE
    return tc.CheckpointPolicy.PREFER_RECOMPUTE


SELECTIVE = {
    "op-list": [torch.ops.aten.addmm.default],
    "policy-fn": _policy_fn,
}


@pytest.mark.parametrize("form", SELECTIVE)
def test_selective_context_fn_reruns_the_same_ops(form: str) -> None:
    block, x = _block(), torch.randn(4, 6)
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, SELECTIVE[form])
    ours = _run(remat.compat.checkpoint, block, x, use_reentrant=False, context_fn=context_fn)
    torch_ = _run(tc.checkpoint, block, x, use_reentrant=False, context_fn=context_fn)
    torch.testing.assert_close(ours["out"], torch_["out"])
    torch.testing.assert_close(ours["grads"], torch_["grads"])
    for op in ("addmm", "gelu", "native_dropout", "tanh", "mm"):
        assert ours["counts"][op] == torch_["counts"][op], op
    # The saved ops are not rerun: only the backward's own matmuls run.
    assert _dots(ours["counts"]) == 4
    assert ours["counts"]["gelu"] == (0 if form == "policy-fn" else 1)


def test_selective_op_list_becomes_save_these_ops() -> None:
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts,
                                   [torch.ops.aten.mm.default])
    assert remat.compat._policy("api", "nothing-saveable", context_fn, _plain) == (
        remat.policies.save_these_ops(torch.ops.aten.mm.default)
    )


def test_context_fn_with_another_policy_raises() -> None:
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, _policy_fn)
    block, x = _block(), torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"policy='dots-saveable' for Sequential\.forward .*; "
                       "give one of them: drop context_fn, or drop policy="):
        remat.compat.checkpoint(block, x, context_fn=context_fn, policy="dots-saveable")


def test_other_context_fn_raises_and_the_fix_works() -> None:
    block, x = _block(0.0), torch.randn(4, 6)

    def autocast_contexts() -> tuple[Any, Any]:
        return torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", torch.bfloat16)

    with pytest.raises(ValueError, match=r"context_fn for Sequential\.forward .* returned .*"
                       "Enter other contexts inside the checkpointed function"):
        remat.compat.checkpoint(block, x, context_fn=autocast_contexts)

    def wrapped(*args: Any) -> torch.Tensor:  # the fix the message gives
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return block(*args)  # type: ignore[no-any-return]

    ours = _run(remat.compat.checkpoint, wrapped, x, params=list(block.parameters()))
    torch_ = _run(tc.checkpoint, block, x, use_reentrant=False, context_fn=autocast_contexts)
    assert ours["out"].dtype == torch_["out"].dtype == torch.bfloat16
    torch.testing.assert_close(ours["out"], torch_["out"])
    torch.testing.assert_close(ours["grads"], torch_["grads"])


def test_reentrant_true_keeps_parameter_gradients_when_no_input_requires_grad() -> None:
    # torch's reentrant variant returns no parameter gradient here (and warns);
    # use_reentrant=True on remat's engine gives the gradients of the plain block.
    block, x = _block(0.0), torch.randn(4, 6)
    remat.compat.checkpoint(block, x, use_reentrant=True).sum().backward()
    ours = [p.grad.clone() for p in block.parameters()]  # type: ignore[union-attr]
    block.zero_grad()
    block(x).sum().backward()
    torch.testing.assert_close(ours, [p.grad for p in block.parameters()])


def test_bad_flags_raise() -> None:
    block, x = _block(), torch.randn(4, 6)
    with pytest.raises(TypeError, match="use_reentrant must be True or False, got 'no'"):
        remat.compat.checkpoint(block, x, use_reentrant="no")
    with pytest.raises(ValueError, match="determinism_check must be True, False, 'default'"):
        remat.compat.checkpoint(block, x, determinism_check="strict")


def test_keyword_arguments_reach_the_function() -> None:
    def f(x: torch.Tensor, *, scale: float, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w) * scale

    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    ours = torch.autograd.grad(remat.compat.checkpoint(f, x, scale=2.0, w=w).sum(), w)
    torch_ = torch.autograd.grad(tc.checkpoint(f, x, scale=2.0, w=w, use_reentrant=False).sum(), w)
    torch.testing.assert_close(ours, torch_)


# -- torch.func ----------------------------------------------------------------


def _func_loss(checkpoint: Any, block: nn.Module, **options: Any) -> Any:
    params = dict(block.named_parameters())

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        def call(x: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(block, p, (x,))  # type: ignore[no-any-return]

        return (checkpoint(call, x, **options) ** 2).sum()

    return loss, {n: v.detach() for n, v in params.items()}


@pytest.mark.parametrize("form", [None, *SELECTIVE])
def test_under_torch_func_grad_and_vmap_where_torch_raises(form: str | None) -> None:
    block, x = _block(0.0), torch.randn(4, 6)
    options: dict[str, Any] = {"use_reentrant": False}
    if form is not None:
        options["context_fn"] = functools.partial(
            tc.create_selective_checkpoint_contexts, SELECTIVE[form]
        )
    loss, params = _func_loss(remat.compat.checkpoint, block, **options)
    plain, _ = _func_loss(_plain, block)
    torch.testing.assert_close(torch.func.grad(loss)(params, x), torch.func.grad(plain)(params, x))
    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    expected = torch.func.vmap(torch.func.grad(plain), in_dims=(None, 0))(params, x)
    torch.testing.assert_close(per_example, expected)
    theirs, _ = _func_loss(tc.checkpoint, block, **options)
    with pytest.raises(RuntimeError, match="saved tensor hooks"):
        torch.func.grad(theirs)(params, x)


def test_checkpoint_sequential_equals_torch() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(6)])
    x = torch.randn(3, 5)
    results = []
    for fn in (remat.compat.checkpoint_sequential, tc.checkpoint_sequential):
        xi = x.clone().requires_grad_()
        out = fn(net, 3, xi, use_reentrant=False)
        with OpCounter() as counter:
            grads = torch.autograd.grad(out.sum(), [xi, *net.parameters()])
        results.append((out.detach(), grads, counter.counts["addmm"]))
    (out, grads, addmm), (t_out, t_grads, t_addmm) = results
    torch.testing.assert_close(out, t_out)
    torch.testing.assert_close(grads, t_grads)
    assert addmm == t_addmm == 4  # segments 1 and 2 rerun; the last segment is kept


class _Sequence(nn.Module):
    def __init__(self, sequential: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(4)])
        self.sequential = sequential

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequential is None:
            return self.layers(x)  # type: ignore[no-any-return]
        return self.sequential(self.layers, 2, x, use_reentrant=False)  # type: ignore[no-any-return]


def test_checkpoint_sequential_under_torch_func() -> None:
    x = torch.randn(3, 5)
    grads = {}
    for name, fn in [("ours", remat.compat.checkpoint_sequential), ("plain", None),
                     ("torch", tc.checkpoint_sequential)]:
        model = _Sequence(fn)
        params = {n: p.detach() for n, p in model.named_parameters()}

        def loss(p: dict[str, torch.Tensor], model: nn.Module = model) -> torch.Tensor:
            return torch.func.functional_call(model, p, (x,)).sum()  # type: ignore[no-any-return]

        if name == "torch":
            with pytest.raises(RuntimeError, match="saved tensor hooks"):
                torch.func.grad(loss)(params)
        else:
            grads[name] = torch.func.grad(loss)(params)
    torch.testing.assert_close(grads["ours"], grads["plain"])


# -- code that takes a checkpoint function ----------------------------------------


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_checkpoint_wrapper(policy: str) -> None:
    block, x = _block(), torch.randn(4, 6)
    plain = _run(_plain, block, x)
    wrapped = checkpoint_wrapper(block, checkpoint_fn=remat.compat.checkpoint, policy=policy)
    ours = _run(_plain, wrapped, x)
    torch.testing.assert_close(ours["out"], plain["out"])
    torch.testing.assert_close(ours["grads"], plain["grads"])
    assert _dots(ours["counts"]) == (6 if policy == "nothing-saveable" else 4)
    loss, params = _func_loss(_plain, wrapped)
    reference, _ = _func_loss(_plain, _block())
    x0 = torch.randn(4, 6)
    torch.manual_seed(3)
    got = torch.func.grad(loss)(params, x0)
    torch.manual_seed(3)
    expected = torch.func.grad(reference)({k.removeprefix("_checkpoint_wrapped_module."): v
                                           for k, v in params.items()}, x0)
    torch.testing.assert_close(
        {k.removeprefix("_checkpoint_wrapped_module."): v for k, v in got.items()}, expected
    )
