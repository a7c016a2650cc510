"""A function torch.func cannot run at all: say so, and where it can run instead.

The torch.func engine runs a region's function under ``torch.func.vjp`` (NOTE [ The
functional engine ] rule 7), so it meets every refusal of functorch
itself. One such refusal comes from code remat does not own: an
``autograd.Function`` without ``setup_context``. DTensor's ``from_local`` and
``to_local`` are two (torch 2.13), run by every tensor-parallel layer
(``ColwiseParallel``, ``RowwiseParallel``). torch's message names neither the
region nor a way out; this one does.
"""

from __future__ import annotations

from .._errors import RematError

__all__ = ["torch_func_refusal"]

#: What functorch says of an autograd.Function it cannot transform.
_NO_SETUP_CONTEXT = "it must override the setup_context staticmethod"


def torch_func_refusal(label: str, error: RuntimeError, transformed: bool) -> RematError | None:
    """The `RematError` for ``error`` raised in region ``label``; None: not a refusal.

    ``transformed``: a torch.func transform of the caller's was active at the call.
    """
    if isinstance(error, RematError) or _NO_SETUP_CONTEXT not in str(error):
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
