"""Bindings both engines' walks must reach: a module's private attribute (``self._mask``,
``self._cos_cached``), a tensor its class holds, a tensor attribute of an imported
module (``tables.MASK``), and the same holding plain data with a tensor in it
(``self._cache["mask"]``, ``self._masks[0]``, a private tuple or namespace, a
class's or an imported module's dict: the third adversarial pass found those
silent in both engines, since only private tensors were walked).

The second adversarial pass found all three silent in both engines: the walks
skipped every attribute whose name starts with "_" (meant for ``_parameters`` and
``_modules``), classes' own tables, and modules. A tensor read there and rebound
or written in place between the forward and the backward gave the gradient of a
forward that never ran (W1.grad 2.6211 -> 5.6787). Now the eager engine raises
(NOTE [ Bindings the recompute reads ]), and the torch.func engine reads what the
forward read (NOTE [ Closed-over tensors ] rule 4) or raises on an in-place write.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from helpers import RecomputeCounter

import remat
from remat._errors import SavedInputMutatedError

D = torch.double
POLICIES = ["nothing-saveable", "dots-saveable"]
KINDS = [
    "private attribute", "class attribute", "module attribute",
    "private dict", "private list", "private tuple", "private namespace",
    "class dict", "module dict",
]

torch.manual_seed(0)
W1 = torch.randn(3, 4, dtype=D, requires_grad=True)
W2 = torch.randn(4, 2, dtype=D, requires_grad=True)


def _body(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ W1 + bias) @ W2  # ``+`` saves nothing of the bias


class Private(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._mask = torch.zeros(4, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _body(x, self._mask)


class ClassHeld(torch.nn.Module):
    mask = torch.zeros(4, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _body(x, self.mask)


class PrivateData(torch.nn.Module):
    """Its mask in a private container of the ``kind`` given."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self._cache = {"mask": torch.zeros(4, dtype=D)}
        self._masks = [torch.zeros(4, dtype=D)]
        self._pair = (torch.zeros(4, dtype=D), 1)
        self._ns = types.SimpleNamespace(mask=torch.zeros(4, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _body(x, self.mask())

    def mask(self) -> torch.Tensor:
        if self.kind == "private dict":
            return self._cache["mask"]
        if self.kind == "private list":
            return self._masks[0]
        if self.kind == "private tuple":
            return self._pair[0]
        return self._ns.mask

    def rebind(self, t: torch.Tensor) -> None:
        if self.kind == "private dict":
            self._cache["mask"] = t
        elif self.kind == "private list":
            self._masks[0] = t
        elif self.kind == "private tuple":
            self._pair = (t, 1)
        else:
            self._ns.mask = t


class ClassTable(torch.nn.Module):
    TABLE: ClassVar[dict[str, torch.Tensor]] = {"mask": torch.zeros(4, dtype=D)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _body(x, self.TABLE["mask"])


tables = types.ModuleType("remat_test_tables")
tables.MASK = torch.zeros(4, dtype=D)  # type: ignore[attr-defined]
tables.MASKS = {"mask": torch.zeros(4, dtype=D)}  # type: ignore[attr-defined]


def module_attribute(x: torch.Tensor) -> torch.Tensor:
    return _body(x, tables.MASK)  # type: ignore[attr-defined]


def module_dict(x: torch.Tensor) -> torch.Tensor:
    return _body(x, tables.MASKS["mask"])  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _fresh_masks() -> Iterator[None]:
    sys.modules[tables.__name__] = tables
    yield
    ClassHeld.mask = torch.zeros(4, dtype=D)
    ClassTable.TABLE = {"mask": torch.zeros(4, dtype=D)}
    tables.MASK = torch.zeros(4, dtype=D)  # type: ignore[attr-defined]
    tables.MASKS = {"mask": torch.zeros(4, dtype=D)}  # type: ignore[attr-defined]
    sys.modules.pop(tables.__name__, None)


def _case(kind: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], torch.Tensor],
                              Callable[[torch.Tensor], None]]:
    """The region, what reads its mask now, and what rebinds it (masks start at zero)."""
    ClassHeld.mask = torch.zeros(4, dtype=D)
    ClassTable.TABLE = {"mask": torch.zeros(4, dtype=D)}
    tables.MASK = torch.zeros(4, dtype=D)  # type: ignore[attr-defined]
    tables.MASKS = {"mask": torch.zeros(4, dtype=D)}  # type: ignore[attr-defined]
    if kind.startswith("private ") and kind != "private attribute":
        data = PrivateData(kind)
        return data, data.mask, data.rebind
    if kind == "class dict":
        return (ClassTable(), lambda: ClassTable.TABLE["mask"],
                functools.partial(ClassTable.TABLE.__setitem__, "mask"))
    if kind == "module dict":
        masks = tables.MASKS  # type: ignore[attr-defined]
        return module_dict, lambda: masks["mask"], functools.partial(masks.__setitem__, "mask")
    if kind == "private attribute":
        module = Private()
        return module, lambda: module._mask, functools.partial(setattr, module, "_mask")
    if kind == "class attribute":
        return (ClassHeld(), lambda: ClassHeld.mask,
                functools.partial(setattr, ClassHeld, "mask"))
    return (module_attribute, lambda: tables.MASK,  # type: ignore[attr-defined]
            functools.partial(setattr, tables, "MASK"))


def _grads(out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.pow(2).sum(), (W1, W2))


def _changed_after_forward(kind: str, wrap: Callable[[Any], Any], in_place: bool) -> torch.Tensor:
    fn, mask, rebind = _case(kind)
    out: torch.Tensor = wrap(fn)(torch.linspace(-1, 1, 15, dtype=D).reshape(5, 3))
    if in_place:
        with torch.no_grad():
            mask().add_(1.0)
    else:
        rebind(torch.ones(4, dtype=D))
    return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", KINDS)
def test_rebound_raises_in_the_eager_engine_and_the_fix_works(kind: str, policy: str) -> None:
    out = _changed_after_forward(kind, lambda f: remat.remat(f, policy=policy, engine="eager"),
                                 in_place=False)
    with pytest.raises(SavedInputMutatedError) as caught:
        _grads(out)
    message = str(caught.value)
    assert "is another tensor than the forward read there" in message, message
    words = {"private attribute": "._mask", "class attribute": ".__class__.mask",
             "module attribute": "global 'tables'.MASK", "private dict": "._cache['mask']",
             "private list": "._masks[0]", "private tuple": "._pair",
             "private namespace": "._ns.mask", "class dict": ".TABLE['mask']",
             "module dict": "MASKS['mask']"}[kind]
    assert words in message, message

    # The fix it names: pass the tensor as an argument.
    _, mask, rebind = _case(kind)
    x = torch.linspace(-1, 1, 15, dtype=D).reshape(5, 3)
    want = _grads(_body(x, mask()))
    fixed = remat.remat(_body, policy=policy, engine="eager")
    with RecomputeCounter() as counter:
        out = fixed(x, mask())
        rebind(torch.ones(4, dtype=D))
        got = _grads(out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert counter.counts["tanh"] == 1, counter.counts


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", KINDS)
def test_rebound_the_torch_func_engine_reads_what_the_forward_read(kind: str, policy: str) -> None:
    want = _grads(_changed_after_forward(kind, lambda f: f, in_place=False))
    with RecomputeCounter() as counter:
        got = _grads(_changed_after_forward(
            kind, lambda f: remat.remat(f, policy=policy, engine="functional"), in_place=False))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert counter.counts["tanh"] == 1, counter.counts


@pytest.mark.parametrize("engine", ["eager", "functional"])
@pytest.mark.parametrize("kind", KINDS)
def test_written_in_place_raises_in_both_engines(kind: str, engine: str) -> None:
    out = _changed_after_forward(kind, lambda f: remat.remat(f, engine=engine), in_place=True)
    with pytest.raises(SavedInputMutatedError, match="in place"):
        _grads(out)


def test_a_private_callable_is_not_walked() -> None:
    """Libraries keep callables in private attributes (Hugging Face's
    ``_gradient_checkpointing_func``, a partial of a checkpoint function): the walk
    does not go into them, so what their globals hold neither costs a step nor
    raises when it changes."""
    reached: dict[str, torch.Tensor] = {"t": torch.zeros(4, dtype=D)}

    def helper() -> torch.Tensor:
        return reached["t"]

    module = Private()
    module._helper = functools.partial(helper)  # never called by the region
    region = remat.remat(module, engine="eager")
    x = torch.linspace(-1, 1, 15, dtype=D).reshape(5, 3)
    want = _grads(module(x))
    out = region(x)
    reached["t"] = torch.ones(4, dtype=D)
    for g, w in zip(_grads(out), want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("engine", ["eager", "functional"])
def test_a_generator_in_a_private_attribute_is_replayed(engine: str) -> None:
    """``self._gen``: found by the walk, so the recompute draws the forward's mask."""

    class Noisy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._gen = torch.Generator().manual_seed(7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            noise = torch.rand(x.shape[0], 4, generator=self._gen, dtype=D)
            return torch.tanh(x @ W1 * noise) @ W2

    x = torch.linspace(-1, 1, 15, dtype=D).reshape(5, 3)
    plain = Noisy()
    want = _grads(plain(x))
    wrapped = Noisy()
    with RecomputeCounter() as counter:
        got = _grads(remat.remat(wrapped, engine=engine)(x))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert counter.counts["tanh"] == 1, counter.counts


@pytest.mark.parametrize("engine", ["eager", "functional"])
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_a_mask_built_lazily_into_a_private_dict(engine: str, policy: str) -> None:
    """A causal mask built on the first call of a length, from no tensor, and kept in
    ``self._masks[T]``, read by two calls before one backward: a correct program.
    The torch.func engine's op-tracing policies raised its hidden-tensor error."""

    class Causal(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.q = torch.nn.Linear(8, 8, dtype=D)
            self._masks: dict[int, torch.Tensor] = {}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[0]
            if n not in self._masks:
                self._masks[n] = torch.ones(n, n).tril().bool()
            h = self.q(x)
            scores = torch.where(self._masks[n], h @ h.t(), torch.full((n, n), -1e9, dtype=D))
            return torch.tanh(torch.softmax(scores, -1) @ h)

    x0 = torch.linspace(-1, 1, 32, dtype=D).reshape(4, 8)
    x1 = torch.linspace(2, -1, 32, dtype=D).reshape(4, 8)

    def grads(wrap: Callable[[Any], Any]) -> list[torch.Tensor]:
        model = Causal()
        region = wrap(model)
        (region(x0).pow(2).sum() + region(x1).pow(3).sum()).backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    want = grads(lambda m: m)
    with RecomputeCounter() as counter:
        got = grads(lambda m: remat.remat(m, policy=policy, engine=engine))
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    if policy != "save-last":
        assert counter.counts["tanh"] == 2, counter.counts
