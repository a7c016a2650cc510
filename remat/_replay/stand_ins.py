"""Meta stand-ins for a recompute's dead ops, and the error when one reaches Python state.

NOTE [ Stand-ins in Python state ]
A recompute does not run dead ops (NOTE [ Record and replay ] rule 5): each
returns a meta tensor of the right shape. Nothing the recompute itself needs
reads it, but ``fn`` may store it where other code reads it later
(``box["h"] = h``, an attribute, a list): the stand-in outlives its recompute.
A later reader (another region's recompute, the user) then fails inside torch
with a device error that names neither region nor a fix. Each stand-in
remembers its log; when a recompute fails on a meta tensor while a stand-in
made by another log's recompute is still alive, `raise_if_leaked` raises `RematError` naming the
region that stored it, the one that failed, and the fix that works: store the
value in the forward only (``if not remat.is_recomputing(): box["h"] = h``,
computing ``h`` in both), or hand it over as a return value and an argument.
Only failures pay for the search; making a stand-in costs one attribute and
one weak reference.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from .._errors import RematError

__all__ = ["raise_if_leaked", "stand_in"]

#: The attribute that says which log's recompute made a stand-in.
_MADE_BY = "_remat_stand_in_of"


class _Origin(NamedTuple):
    log_serial: int
    label: str
    op: str


#: Every stand-in still alive, by id (most die with their recompute). Not a
#: ``WeakSet``: on a hash collision it would compare two tensors with ``==``.
_alive: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def stand_in(meta: tuple[Any, ...], log_serial: int, label: str, op: Any) -> torch.Tensor:
    """A meta tensor shaped like a dead op's output; nothing live reads it.

    On the meta device it costs nothing, and Python reading it without an op
    (``tolist()``, ``numpy()``) fails loudly instead of passing garbage on.

    Examples:
        >>> t = stand_in(((2, 3), (3, 1), torch.float32), 7, "f (x.py:1)", "add")
        >>> t.device.type, tuple(t.shape)
        ('meta', (2, 3))
    """
    shape, stride, dtype = meta
    t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    setattr(t, _MADE_BY, _Origin(log_serial, label, str(op)))
    _alive[id(t)] = t
    return t


def raise_if_leaked(label: str, log_serial: int | None, error: BaseException) -> None:
    """Raise `RematError` if ``error`` may come from another recompute's stand-in.

    ``label`` and ``log_serial`` are the failing region's (its own stand-ins,
    alive in its traceback, are not a leak; None: it records no log). Only an
    error that names the meta device counts: a hook's list may hold stand-ins that
    nothing reads, and another failure is not theirs.
    """
    if "meta" not in str(error):
        return
    leaked = [
        (origin, t)
        for t in list(_alive.values())
        if (origin := getattr(t, _MADE_BY, None)) is not None
        and origin.log_serial != log_serial
    ]
    if not leaked:
        return
    origin, t = leaked[-1]
    raise RematError(
        f"remat: the recompute of {label} failed ({type(error).__name__}: "
        f"{str(error).splitlines()[0] if str(error) else ''}) while a stand-in made by "
        f"the recompute of {origin.label} is held by Python state: a meta tensor of "
        f"shape {tuple(t.shape)} for its op {origin.op}, which that recompute skipped "
        "because backward does not need its result (NOTE [ Record and replay ] rule 5), "
        "and which that region stored where other code reads it (a dict, a list, an "
        "attribute) while recomputing. Store it in the forward only: compute the value "
        "as before and write `if not remat.is_recomputing(): box['h'] = h` in that "
        "region, or return it from the region and pass it to the code that reads it."
    ) from error
