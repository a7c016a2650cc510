"""Exact memory measurement: live tensor bytes of a training step.

NOTE [ How the CPU meter counts ]
1. `MemoryMeter` is a `TorchDispatchMode`. It sees every tensor an aten op
   returns, below autograd and below every dispatch mode entered after it (the
   engines' record and replay modes pass ops on to it), in the forward *and*
   in the backward pass: autograd runs CPU backward ops on the calling thread
   with the forward's dispatch-mode stack restored.
2. Bytes are counted per *untyped storage*: a view, a detached alias or an
   in-place result shares its source's storage and adds nothing. A storage is
   released by a `weakref.finalize` on its Python object; torch keeps that
   object alive exactly as long as the storage itself (whoever holds it: a
   Python tensor, an autograd saved variable, a C++ graph node), so the
   finalizer fires the moment the memory is freed.
3. Storages that exist before the meter starts (parameters, inputs, existing
   ``.grad`` tensors) are the *baseline*. They are found when an op first reads
   them, or declared with `MemoryMeter.add_baseline`. `current`/`peak` exclude
   the baseline; `peak_total` includes it.
4. What the meter cannot see: scratch buffers a kernel allocates and frees
   inside one op (they never become an op's output) and allocator overhead.
   That is what "exact" means here: the bytes of every tensor an op produced,
   for as long as anything holds it.
5. On exit the finalizers are detached: the counts freeze at the moment the
   meter exits and the meter holds no reference to any storage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

from .._compat import TorchDispatchMode

__all__ = ["ComputeOpCounter", "MemoryMeter", "MemoryReport", "measure_memory"]


class MemoryMeter(TorchDispatchMode):
    """Count the live bytes of every tensor storage that ops create while active.

    Use as a context manager around forward and backward. ``current`` and
    ``peak`` count only storages created while the meter is active; the
    storages that existed before (the baseline: parameters, inputs) are in
    ``baseline`` and included in ``peak_total``.

    Attributes:
        current (int): bytes of the storages created under the meter still alive.
        peak (int): the largest value ``current`` has reached.
        baseline (int): bytes of the live storages that existed before the meter.
        peak_total (int): the largest value of ``baseline + current``.

    Examples:
        >>> import torch
        >>> x = torch.ones(256)                         # 1 KiB, alive before: baseline
        >>> with MemoryMeter() as meter:
        ...     y = x * 2                               # +1 KiB
        ...     z = y.view(16, 16)                      # a view: +0
        ...     t = (y + 1).sum()                       # +1 KiB temporary, freed; +4 bytes
        >>> meter.current, meter.peak, meter.baseline
        (1028, 2052, 1024)
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.current = 0
        self.peak = 0
        self.baseline = 0
        self.peak_total = 0
        # data_ptr -> (nbytes, is_baseline, finalizer); a freed storage is removed
        # by its finalizer before its address can be reused.
        self._live: dict[int, tuple[int, bool, weakref.finalize[Any, Any]]] = {}

    # -- counting --------------------------------------------------------------

    def _track(self, storage: torch.UntypedStorage, baseline: bool) -> None:
        nbytes = storage.nbytes()
        if nbytes == 0 or storage.device.type == "meta":
            return
        key = storage.data_ptr()
        if key in self._live:
            return
        finalizer = weakref.finalize(storage, self._release, key)
        finalizer.atexit = False
        self._live[key] = (nbytes, baseline, finalizer)
        if baseline:
            self.baseline += nbytes
        else:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        self.peak_total = max(self.peak_total, self.baseline + self.current)

    def _release(self, key: int) -> None:
        nbytes, baseline, _ = self._live.pop(key)
        if baseline:
            self.baseline -= nbytes
        else:
            self.current -= nbytes

    def add_baseline(self, tree: Any) -> None:
        """Count the tensors of ``tree`` (any pytree, or an ``nn.Module``) as baseline.

        Args:
            tree (Any): tensors, a pytree of them, or a module (its parameters,
                buffers and their ``.grad``).
        """
        for t in _tensors(tree):
            self._track_tensor(t, baseline=True)

    # -- dispatch --------------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # Inputs first: a storage an op reads that we have never seen existed
        # before the meter (a parameter, a closed-over tensor) - the baseline.
        for t in _tensors((args, kwargs)):
            self._track_tensor(t, baseline=True)
        out = func(*args, **kwargs)
        for t in _tensors(out):
            self._track_tensor(t, baseline=False)
        return out

    def _track_tensor(self, t: torch.Tensor, baseline: bool) -> None:
        # Forward-mode AD's zero tangents (`_efficientzerotensor`) own no memory.
        if not t._is_zerotensor():
            self._track(t.untyped_storage(), baseline)

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        super().__exit__(exc_type, exc_value, traceback)  # type: ignore[no-untyped-call]
        for _, _, finalizer in self._live.values():
            finalizer.detach()
        self._live.clear()


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.nn.Module):
        for t in (*tree.parameters(), *tree.buffers()):
            yield t
            if t.grad is not None:
                yield t.grad
        return
    for leaf in optree.tree_leaves(tree, none_is_leaf=True):
        if isinstance(leaf, torch.Tensor):
            yield leaf


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Memory of one training step (forward and backward), in bytes.

    Attributes:
        peak_bytes (int): the most bytes alive at any moment of the step, not
            counting the baseline.
        held_bytes (int): bytes alive right after the forward pass (what is held
            for backward, plus the loss), not counting the baseline.
        baseline_bytes (int): bytes alive before the step that the step used
            (parameters, inputs); on CUDA, everything allocated before the step.
    """

    peak_bytes: int
    held_bytes: int
    baseline_bytes: int


def measure_memory(fn: Callable[..., torch.Tensor], *args: Any) -> MemoryReport:
    """Measure the memory of ``fn(*args).backward()``.

    ``fn`` returns a scalar loss. On CPU the bytes are counted exactly by
    `MemoryMeter`; when an argument lives on a CUDA device, the CUDA caching
    allocator's statistics for that device are used instead. Gradients
    accumulated into existing ``.grad`` tensors are not new memory; set them to
    ``None`` first to count the gradients too. The cyclic garbage collector is
    paused during the step, so the count does not depend on when it would have
    run: memory that only a reference cycle keeps alive stays counted.

    Args:
        fn (callable): the step's forward; returns a scalar tensor.
        *args (Any): its arguments (pytrees allowed). When ``fn`` is an
            ``nn.Module``, its parameters and buffers are baseline.

    Returns:
        MemoryReport: peak and held bytes, and the baseline.

    Examples:
        >>> import torch
        >>> w = torch.ones(64, 64, requires_grad=True)  # 16 KiB
        >>> x = torch.ones(8, 64)                       # 2 KiB
        >>> r = measure_memory(lambda x: (x @ w).sum(), x)
        >>> r.baseline_bytes, r.held_bytes              # held: the loss (x, w are baseline)
        (18432, 4)
        >>> r.peak_bytes                    # w.grad + the loss + its seed gradient ones_like(loss)
        16392
    """
    device = _cuda_device(args)
    with _gc_paused():
        if device is not None:
            return _measure_cuda(fn, args, device)
        return _measure_cpu(fn, args)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    gc.collect()  # garbage of earlier work must not be freed inside the step
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _measure_cpu(fn: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> MemoryReport:
    with MemoryMeter() as meter:
        if isinstance(fn, torch.nn.Module):
            meter.add_baseline(fn)
        meter.add_baseline(args)
        loss = fn(*args)
        # Read after the forward: a closed-over tensor joins the baseline when first read.
        held, baseline = meter.current, meter.baseline
        loss.backward()
        del loss
        return MemoryReport(meter.peak, held, baseline)


def _cuda_device(args: Any) -> torch.device | None:
    for t in _tensors(args):
        if t.device.type == "cuda":
            return t.device
    return None


def _measure_cuda(
    fn: Callable[..., torch.Tensor], args: tuple[Any, ...], device: torch.device
) -> MemoryReport:
    # The caching allocator counts every live block on the device, so the
    # baseline is everything allocated before the step.
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = fn(*args)
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - baseline
    loss.backward()
    del loss
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    return MemoryReport(peak, held, baseline)


class ComputeOpCounter(TorchDispatchMode):
    """Count the aten ops that compute something (not views, not detaches) while active.

    Entered around a backward pass, it counts the backward's ops plus whatever
    the recompute reruns: the demo and `remat.compare` subtract no remat's count.

    Examples:
        >>> import torch
        >>> x = torch.randn(3, 3)
        >>> with ComputeOpCounter() as counter:
        ...     _ = (x @ x).t().sin()
        >>> counter.count
        2
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if not (func.is_view or func.overloadpacket is torch.ops.aten.detach):
            self.count += 1
        return func(*args, **(kwargs or {}))
