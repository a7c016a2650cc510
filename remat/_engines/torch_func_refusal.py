"""A function torch.func cannot run at all: say so, and where it can run instead.

``.backward()`` inside the region (`backward_inside`), and the refusals below:
an in-place write to an input, saved-tensor hooks, ``requires_grad_()``, a
gradient hook where the forward runs without autograd, mixed dtypes in a
backward under autocast.

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

from .._errors import RematError, SavedInputMutatedError

__all__ = ["backward_inside", "is_backward_call", "torch_func_refusal"]

#: What functorch says of an autograd.Function it cannot transform.
_NO_SETUP_CONTEXT = "it must override the setup_context staticmethod"
#: What functorch says of a ``.backward()`` under one of its transforms.
_BACKWARD_REFUSED = "backward() called inside a functorch transform"
#: What autograd says of an in-place op on a leaf that requires grad (the Function's
#: input, under ``torch.func.vjp``).
_LEAF_IN_PLACE = "a leaf Variable that requires grad is being used in an in-place operation"


def torch_func_refusal(
    label: str, error: RuntimeError, transformed: bool, backward: bool = False
) -> RematError | None:
    """The `RematError` for ``error`` raised in region ``label``; None: not a refusal.

    ``transformed``: a torch.func transform of the caller's was active at the call;
    ``backward``: raised in the backward's recompute (the forward, which ran
    the same function, had no dtype mismatch: the backward's is torch.func's).
    """
    if isinstance(error, RematError):
        return None
    text = str(error)
    if _BACKWARD_REFUSED in text:  # one the guard did not see first (`backward_inside`)
        return backward_inside(label, transformed)
    if _NO_SETUP_CONTEXT in text:
        return _no_setup_context(label, transformed)
    if _LEAF_IN_PLACE in text:
        return SavedInputMutatedError(
            f"remat: {label} modifies its input in place, so its recompute would start "
            "from the modified value (the torch.func engine refuses it: torch says "
            f"{text.splitlines()[0]!r}). Clone the input inside the function before "
            "modifying it, or use policy='everything-saveable'."
        )
    for known, what, inside in _REFUSED:
        if known in text:
            return _refused(label, f"{what} (torch: {text.splitlines()[0]!r})", inside,
                            transformed)
    if backward and any(known in text for known in _DTYPE_MISMATCH):
        return _autocast_mismatch(label, text, transformed)
    return None


def _no_setup_context(label: str, transformed: bool) -> RematError:
    what = (
        f"remat: {label} runs an autograd.Function without setup_context (a module's "
        "register_full_backward_hook runs one, BackwardHookFunction; so do DTensor's "
        "from_local/to_local, which tensor-parallel layers run), and torch.func "
        "transforms refuse those"
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


#: torch's words for what it refuses under torch.func, what the region did, and the
#: fix under a transform (outside one, the eager engine runs it).
_REFUSED = (
    (
        "don't yet support saved tensor hooks",
        "uses saved-tensor hooks (torch.utils.checkpoint, saved_tensors_hooks, "
        "save_on_cpu) inside the region, or is called inside them, and the torch.func "
        "engine runs it under torch.func.vjp, where torch refuses them",
        "Use a remat region instead of torch.utils.checkpoint (remat regions nest, "
        "under torch.func transforms too).",
    ),
    (
        "attempting to call Tensor.requires_grad_()",
        "calls Tensor.requires_grad_() (or torch.autograd.functional) inside the "
        "region, and the torch.func engine runs it under torch.func.vjp, where torch "
        "refuses that",
        "Compute that gradient with torch.func inside the function (forces as "
        "-torch.func.grad(energy)(pos)).",
    ),
    (
        "cannot register a hook on a tensor that doesn't require gradient",
        "registers a gradient hook (Tensor.register_hook) on a tensor inside the "
        "region, and the torch.func engine runs this policy's forward without autograd",
        "Register the hook outside the region, on its output.",
    ),
)

#: What torch says when a matmul gets two dtypes.
_DTYPE_MISMATCH = ("to have the same dtype", "expected scalar type")


def _refused(label: str, what: str, inside: str, transformed: bool) -> RematError:
    if transformed:
        return RematError(
            f"remat: {label} {what}. Under a torch.func transform torch refuses it with or "
            f"without remat. {inside}"
        )
    return RematError(
        f"remat: {label} {what}. Use engine='auto' (the default) or engine='eager' for "
        "this region: under loss.backward() they run it with saved-tensor hooks, where "
        "it works."
    )


def _autocast_mismatch(label: str, text: str, transformed: bool) -> RematError:
    what = (
        f"remat: the backward of {label} failed inside the torch.func engine's "
        f"torch.func.vjp on two dtypes (torch: {text.splitlines()[0]!r}): under "
        "torch.func, autocast (around or inside the region) casts below the "
        "transform's level, and some backward formulas (attention with dropout) then "
        "meet two dtypes."
    )
    if transformed:
        return RematError(
            f"{what} Enter torch.autocast around the whole torch.func transform (its "
            "backward then runs under autocast too), not only inside it."
        )
    return RematError(
        f"{what} Use engine='auto' (the default) or engine='eager' for this region: "
        "under loss.backward() they run it with saved-tensor hooks, where it works."
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
