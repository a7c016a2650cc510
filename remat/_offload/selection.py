"""Which host store a region offloads to.

NOTE [ Offload: streams, events, prefetch ] (``store.py``), rule 7.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .._state import local
from .cuda import CudaHostStore
from .store import HostStore

_default: HostStore | None = None


@contextlib.contextmanager
def use_host_store(store: HostStore) -> Iterator[HostStore]:
    """Send offloaded values of regions whose forward runs inside to ``store``.

    Args:
        store (HostStore): the store, e.g. a `FakeHostStore` in tests.

    Yields:
        HostStore: ``store``.

    Examples:
        >>> import torch, remat
        >>> from remat._offload.fake import FakeHostStore
        >>> store = FakeHostStore(min_bytes=0)
        >>> f = remat.remat(lambda x, w: (x @ w).sin(), policy="offload-dots")
        >>> x, w = torch.randn(2, 3), torch.randn(3, 3, requires_grad=True)
        >>> with use_host_store(store):
        ...     loss = f(x, w).sum()
        >>> loss.backward()
        >>> [verb for verb, _ in store.log]
        ['put', 'get', 'release']
    """
    stack: list[HostStore] = local.host_stores
    stack.append(store)
    try:
        yield store
    finally:
        stack.pop()


def current_store(region_store: HostStore | None = None) -> HostStore:
    """The store a region uses: its own, else the innermost `use_host_store`, else CUDA's."""
    global _default
    if region_store is not None:
        return region_store
    stack: list[HostStore] = local.host_stores
    if stack:
        return stack[-1]
    if _default is None:
        _default = CudaHostStore()
    return _default
