"""A function torch.func cannot run at all: say so, and where it can run instead.

Two kinds: ``.backward()`` inside the region (`backward_inside`), and the one below.

The torch.func engine runs a region's function under ``torch.func.vjp`` (NOTE [ The
functional engine ] rule 7), so it meets every refusal of functorch
itself. One such refusal comes from code remat does not own: an
``autograd.Function`` without ``setup_context``. DTensor's ``from_local`` and
``to_local`` are two (torch 2.13), run by every tensor-parallel layer
(``ColwiseParallel``, ``RowwiseParallel``). torch's message names neither the
region nor a way out; this one does.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import RematError

__all__ = ["backward_inside", "is_backward_call", "torch_func_refusal"]

#: What functorch says of an autograd.Function it cannot transform.
_NO_SETUP_CONTEXT = "it must override the setup_context staticmethod"
#: What functorch says of a ``.backward()`` under one of its transforms.
_BACKWARD_REFUSED = "backward() called inside a functorch transform"


def torch_func_refusal(label: str, error: RuntimeError, transformed: bool) -> RematError | None:
    """The `RematError` for ``error`` raised in region ``label``; None: not a refusal.

    ``transformed``: a torch.func transform of the caller's was active at the call.
    """
    if isinstance(error, RematError):
        return None
    if _BACKWARD_REFUSED in str(error):  # one the guard did not see first (`backward_inside`)
        return backward_inside(label, transformed)
    if _NO_SETUP_CONTEXT not in str(error):
        return None
    what = (
        f"remat: {label} runs an autograd.Function without setup_context (DTensor's "
        "from_local/to_local, which tensor-parallel layers run, are such Functions), "
        "and torch.func transforms refuse those"
    )
    if transformed:
        return RematError(
            f"{what}: torch refuses this function under torch.func with or without remat. "
            "Differentiate it with loss.backward() (or torch.autograd.grad) instead, where "
            "remat runs it in its eager engine."
        )
    return RematError(
        f"{what}; the torch.func engine runs the region under torch.func.vjp. Use "
        "engine='auto' (the default) or engine='eager' for this region: outside torch.func "
        "transforms they run it with saved-tensor hooks."
    )


def is_backward_call(func: Any) -> bool:
    """Whether a torch call is ``.backward()`` (the method or ``torch.autograd.backward``)."""
    return func is torch.Tensor.backward or func is torch.autograd.backward


def backward_inside(label: str, transformed: bool) -> RematError:
    """``fn`` calls ``.backward()`` in a forward the torch.func engine runs.

    Under a transform torch refuses it whatever the policy; a region whose
    forward runs without autograd (``nothing-saveable``: an ``autograd.Function``
    forward) would otherwise fail with torch's "element 0 of tensors does not
    require grad", which names neither the region nor the way out.
    ``transformed``: a torch.func transform of the caller's was active at the call.
    """
    what = f"remat: {label} calls .backward() inside the region"
    if transformed:
        return RematError(
            f"{what}, under a torch.func transform: torch refuses that with or without "
            "remat (backward() called inside a functorch transform). Compute that "
            "gradient with torch.func.grad or torch.func.vjp inside the function, or "
            "differentiate the whole computation with loss.backward() (or "
            "torch.autograd.grad) outside torch.func transforms, where remat runs the "
            "region in its eager engine and the .backward() inside works."
        )
    return RematError(
        f"{what}, and engine='functional' runs the function as an autograd.Function "
        "forward (under torch.func.vjp, or without autograd), where .backward() cannot "
        "work. Use engine='auto' (the default) or engine='eager' for this region: under "
        "loss.backward() they run it with saved-tensor hooks, where it works."
    )
