"""Both engines report a recompute signature that differs through one entry.

NOTE [ Recompute signatures ] rule 5: ``_replay/checks.py``'s `expect_same`
(and `differs`) builds every such message, "<what> (forward: ...; recompute:
...)", after the region's name and source line and before the cures. Under
``nothing-saveable`` (no op log: these signatures are the only check) the eager
engine compares saved tensors and how many there were, the torch.func engine its
calls, the makers of its outputs and its output structure. Each test applies the
cure the message names last (``policy='everything-saveable'``) and checks the
gradients then match the program without remat.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from helpers import assert_close_each

import remat
from remat._replay.checks import differs, expect_same
from tests.conftest import Engine

Fn = Callable[..., object]

_FLAG = {"forward": True}


def flipped(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sin`` in the forward, ``cos`` in the recompute: same shapes, other values."""
    h = x @ w
    h = h.sin() if _FLAG["forward"] else h.cos()
    return h @ w


def shortened(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The forward's last op (which saves its output) is gone from the recompute."""
    h = x @ w
    return h.exp() if _FLAG["forward"] else h


def narrowed(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Two outputs in the forward, one in the recompute, made by the same calls."""
    h = (x @ w).tanh()
    return (h, h * 2) if _FLAG["forward"] else (h,)


def _program(block: Fn) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        _FLAG["forward"] = True
        out = block(x, w)
        _FLAG["forward"] = False  # flipped after the forward, before the backward
        leaves = out if isinstance(out, tuple) else (out,)
        return sum(t.pow(2).sum() for t in leaves)  # type: ignore[return-value]

    return program


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, dtype=torch.float64, generator=generator)
    return x, torch.randn(8, 8, dtype=torch.float64, generator=generator) / 3


def _message(engine: Engine, region_fn: Fn) -> str:
    """The error of ``region_fn``'s program under ``engine``, checked for region, line, cure."""
    x, w = _inputs()
    block = engine.remat(region_fn, policy="nothing-saveable")
    with pytest.raises(remat.NondeterministicRecomputeError) as info:
        engine.grads(_program(block), x, w)  # type: ignore[arg-type]
    message = str(info.value)
    line = region_fn.__code__.co_firstlineno  # type: ignore[attr-defined]
    name = region_fn.__name__  # type: ignore[attr-defined]
    assert re.search(rf"the recompute of {name} \(.*test_recompute_check_entry\.py:{line}\)"
                     r" differs from its forward: ", message), message
    assert "Its gradients would be wrong. Usual causes and their fixes" in message
    assert "policy='everything-saveable'" in message
    # The cure works: nothing recomputed, the gradients of the program without remat.
    cured = engine.remat(region_fn, policy="everything-saveable")
    leaves = [t.detach().requires_grad_() for t in (x, w)]
    expected = torch.autograd.grad(_program(region_fn)(*leaves), leaves)
    assert_close_each(engine.grads(_program(cured), x, w), expected)  # type: ignore[arg-type]
    return message


def test_each_engine_reports_a_different_op_as_its_own_signature(engine: Engine) -> None:
    message = _message(engine, flipped)
    if engine.name == "eager":  # what the second matmul saves: sin's output, then cos's
        pattern = (r"saved tensor #4 \(forward: shape \(4, 8\), torch.float64 on cpu, made by "
                   r"SinBackward0; recompute: shape \(4, 8\), torch.float64 on cpu, made by "
                   r"CosBackward0\) \(debug=True shows both op logs; .*?run it under "
                   r"`torch.no_grad\(\)`\)\. ")
    else:  # the second call: Tensor.sin, then Tensor.cos, on the same shapes
        pattern = (r"call #1 \(forward: Tensor.sin on tensors of shape \[\(4, 8\) "
                   r"torch.float64\]; recompute: Tensor.cos on tensors of shape \[\(4, 8\) "
                   r"torch.float64\]\)\. ")
    assert re.search(pattern, message), message


def test_each_engine_reports_a_missing_last_op(engine: Engine) -> None:
    message = _message(engine, shortened)
    if engine.name == "eager":  # x and w for the matmul, then exp's output
        expected = ("the number of tensors it saved (forward: 3; recompute: 2): it ran "
                    "different ops the second time. ")
    else:
        expected = ("the maker of its output #0 (forward: call #1 (Tensor.exp on tensors of "
                    "shape [(4, 8) torch.float64]); recompute: call #0 (Tensor.matmul on "
                    "tensors of shape [(4, 8) torch.float64, (8, 8) torch.float64])). ")
    assert expected in message, message


def test_the_functional_engine_reports_its_output_structure() -> None:
    message = _message(Engine("functional"), narrowed)
    assert re.search(r"its output structure \(forward: PyTreeSpec\(\(\*, \*\)\); "
                     r"recompute: PyTreeSpec\(\(\*,\)\)\)\. ", message), message


def test_the_entry_compares_with_the_given_test_and_describes_both_sides() -> None:
    expect_same("f (a.py:1)", "the count", 2, 2)
    expect_same("f (a.py:1)", "the sign", -1, 1, same=lambda a, b: abs(a) == abs(b))
    with pytest.raises(remat.NondeterministicRecomputeError) as info:
        expect_same("f (a.py:1)", "the count", 2, 3, describe=lambda n: f"{n} items",
                    hint="; see the logs")
    assert str(info.value).startswith(
        "remat: the recompute of f (a.py:1) differs from its forward: the count "
        "(forward: 2 items; recompute: 3 items); see the logs. Its gradients would be wrong."
    )
    error = differs("f (a.py:1)", "the count", 2, 3, after="\nLOGS")
    assert str(error).endswith("(nothing is recomputed; memory as without remat).\nLOGS")
