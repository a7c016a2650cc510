"""The kept module tree (NOTE [ The kept module tree ] in ``_capture/module_tree.py``):
the state guard's listing of a region's module subtree, kept between calls, is
listed again whenever the tree changes, and keeps no module alive."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat._capture.module_tree import named_subtree
from remat._errors import SavedInputMutatedError


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.Tanh()), nn.Linear(3, 3)
    )


def _listing(module: nn.Module) -> list[tuple[str, int]]:
    return [(name, id(sub)) for name, sub in module.named_modules(remove_duplicate=False)]


# Each change returns what it took out of the tree, which the test keeps alive: a
# module freed is seen by its dead weak reference alone, a live one only by the check.
def _replace_grandchild(net: nn.Module) -> object:
    old = net[1][0]
    net[1][0] = nn.Linear(3, 3)
    return old


def _delete_child(net: nn.Module) -> object:
    old = net[2]
    del net[2]
    return old


def _add_child(net: nn.Module) -> object:
    net.add_module("extra", nn.ReLU())
    return None


def _rename_child(net: nn.Module) -> object:
    child = net._modules.pop("2")
    net.add_module("renamed", child)
    return None


def _share_child(net: nn.Module) -> object:
    old = net[2]
    net[2] = net[0]  # the same module twice: listed twice, as named_modules does
    return old


def _none_child(net: nn.Module) -> object:
    old = net[1]._modules["1"]
    net[1]._modules["1"] = None
    return old


@pytest.mark.parametrize(
    "change",
    [_replace_grandchild, _delete_child, _add_child, _rename_child, _share_child, _none_child],
)
def test_listing_follows_every_change(change: Callable[[nn.Module], object]) -> None:
    net = _net()
    assert [(n, id(m)) for n, m in named_subtree(net)] == _listing(net)
    assert [(n, id(m)) for n, m in named_subtree(net)] == _listing(net)  # kept
    taken_out = change(net)
    assert [(n, id(m)) for n, m in named_subtree(net)] == _listing(net)
    del taken_out


def test_kept_listing_keeps_no_module_alive() -> None:
    net = _net()
    named_subtree(net)
    inner = weakref.ref(net[1][0])
    root = weakref.ref(net)
    _replace_grandchild(net)  # the listing still names the old child until listed again
    gc.collect()
    assert inner() is None
    del net
    gc.collect()
    assert root() is None


class _ReadsChildWeight(nn.Module):
    """Reads its child's weight without calling the child, through an op that saves
    nothing (a scalar multiple): only the root's pin sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.inner.weight * 2.0)).exp()


@pytest.mark.parametrize("policy", ["nothing-saveable", "save-last", "dots-saveable"])
def test_replaced_child_is_pinned_on_the_next_call(policy: str) -> None:
    """A child replaced between two calls: the second call pins the new child's weight,
    so an in-place write to it before backward raises instead of a silent recompute
    from the new values (a kept listing of the old tree would not pin it)."""
    torch.manual_seed(0)
    net = _ReadsChildWeight()
    region = remat.remat(net, policy=policy, engine="eager")
    x = torch.randn(2, 3, requires_grad=True)
    region(x).sum().backward()  # the first call lists the tree
    old = net.inner  # kept alive: only the tree check sees the change
    net.inner = nn.Linear(3, 3)
    loss = region(region(x)).sum()  # a chain: the first call is recomputed under save-last
    with torch.no_grad():
        net.inner.weight.add_(1.0)
    with pytest.raises(SavedInputMutatedError, match="weight"):
        loss.backward()
    # The fix the message names: modify after backward. Gradients equal no remat's.
    net.zero_grad(set_to_none=True)
    region(region(x)).sum().backward()
    got = net.inner.weight.grad
    net.zero_grad(set_to_none=True)
    net(net(x)).sum().backward()
    torch.testing.assert_close(got, net.inner.weight.grad)
    del old
