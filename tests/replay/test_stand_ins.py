"""Which failures `raise_if_leaked` blames on a stand-in kept in Python state
(NOTE [ Stand-ins in Python state ] in ``remat/_replay/stand_ins.py``)."""

from __future__ import annotations

import gc

import pytest
import torch

import remat
from remat._replay import stand_ins
from remat._replay.stand_ins import raise_if_leaked, stand_in

META_ERROR = RuntimeError("Tensor on device meta is not on the expected device cpu!")


def test_a_kept_stand_in_of_another_log_explains_a_meta_failure() -> None:
    stand_ins._alive.clear()  # stand-ins an earlier test's state still holds
    kept = stand_in(((2, 3), (3, 1), torch.float32), 10**9, "a (x.py:1)", "aten.add.Tensor")
    raise_if_leaked("b (y.py:2)", 10**9, META_ERROR)  # its own log: not a leak
    raise_if_leaked("b (y.py:2)", None, RuntimeError("shapes do not match"))  # not meta
    with pytest.raises(remat.RematError, match=r"recompute of b \(y\.py:2\) failed .* made by "
                       r"the recompute of a \(x\.py:1\) .* shape \(2, 3\) for its op "
                       r"aten\.add\.Tensor") as info:
        raise_if_leaked("b (y.py:2)", None, META_ERROR)
    assert info.value.__cause__ is META_ERROR
    key = id(kept)
    del kept, info
    gc.collect()
    assert key not in stand_ins._alive  # gone with its last reference: nothing to blame
