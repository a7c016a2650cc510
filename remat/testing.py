"""Test doubles for checking your own code with remat: exact CPU memory, op counts, offload.

Everything here is what remat's own tests use:

- `MemoryMeter`: the exact CPU byte meter behind `remat.measure_memory` (a
  dispatch mode counting the live bytes of every tensor storage ops create).
- `ComputeOpCounter`: counts the aten ops that compute something, e.g. around a
  backward pass to see how many ops a policy recomputes.
- `FakeHostStore`: a CPU-to-CPU `remat.HostStore` that logs every call, so
  offload policies can be tested without a GPU.

Examples:
    >>> import torch, remat
    >>> from remat.testing import ComputeOpCounter, FakeHostStore, MemoryMeter
    >>> w = torch.randn(64, 64, requires_grad=True)
    >>> f = remat.remat(lambda x: torch.tanh(torch.tanh(x @ w) @ w).sum(), policy="offload-dots")
    >>> store = FakeHostStore()
    >>> with remat.use_host_store(store), MemoryMeter() as meter:
    ...     loss = f(torch.randn(8, 64))
    ...     with ComputeOpCounter() as counter:
    ...         loss.backward()
    >>> store.calls("put") == [0, 1], counter.count > 0, meter.peak > 0
    (True, True, True)
"""

from ._inspect.memory import ComputeOpCounter as ComputeOpCounter
from ._inspect.memory import MemoryMeter as MemoryMeter
from ._offload.fake import FakeHostStore as FakeHostStore

__all__ = ["ComputeOpCounter", "FakeHostStore", "MemoryMeter"]
