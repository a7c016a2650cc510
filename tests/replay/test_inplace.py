"""In-place writes to values the recompute reads.

A write is seen through every alias (an ``_unsafe_view`` of a kept output, an
offloaded copy); a value written after it was saved is recomputed, and a parameter
written before the backward raises like plain autograd.
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_remat, w44, x3

import remat
from remat._offload.fake import FakeHostStore


def _matmul_then_inplace(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # matmul on a 3-D input runs view -> mm -> _unsafe_view: the result aliases
    # mm's output without sharing its version counter, so `mul_` writes into the
    # kept mm output unseen, and the replay returns the already-doubled value.
    y = x @ w
    y.mul_(2)
    return y.sin()


@pytest.mark.parametrize("policy", ["dots-saveable", "offload-dots"])
def test_inplace_through_unsafe_view_of_kept_output(policy: str) -> None:
    check_remat(_matmul_then_inplace, [x3(), w44()], policy)


def test_inplace_through_unsafe_view_of_offloaded_output() -> None:
    check_remat(
        _matmul_then_inplace,
        [x3(), w44()],
        "offload-dots",
        offload_store=FakeHostStore(min_bytes=0),
    )


@pytest.mark.parametrize("policy", ["dots-saveable", "save-last"])
def test_kept_tensor_written_in_place_after_save_is_recomputed(policy: str) -> None:
    # Plain autograd refuses this (saved `h` was modified); saved-tensor hooks
    # switch that check off, so the engine checks versions itself and recomputes
    # the value as it was when it was saved.
    def f(x, w):  # type: ignore[no-untyped-def]
        h = x @ w
        y = h.sin()
        h.add_(1)
        return y

    x = torch.randn(3, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    expected = torch.autograd.grad((x @ w).sin().sum(), (x, w))
    got = torch.autograd.grad(remat.remat(f, policy=policy)(x, w).sum(), (x, w))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_parameter_written_in_place_before_backward_raises_like_autograd() -> None:
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(3, 3, requires_grad=True)  # so that the matmul saves w
    out = remat.remat(lambda x, w: (x @ w).sin(), policy="dots-saveable")(x, w).sum()
    with torch.no_grad():
        w.add_(1)  # an optimizer step between forward and backward
    with pytest.raises(remat.SavedInputMutatedError, match="modified by an inplace operation"):
        out.backward()
