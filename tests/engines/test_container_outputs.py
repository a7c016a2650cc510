"""Regions return any container: gradients match no-remat, the container comes back whole.

Registered pytrees, namedtuples, dataclasses, dict/list/tuple subclasses and Hugging
Face ``ModelOutput``s are seen into by both engines; an object holding a tensor that
remat cannot see into raises `RematError` in both, and the registration its message
suggests makes it work.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from helpers import CORE_POLICIES, OpCounter

import remat


def _body(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    return h, (h @ w).sin()


@dataclasses.dataclass
class Pair:
    hidden: torch.Tensor
    out: torch.Tensor
    note: str = "pair"


@dataclasses.dataclass(frozen=True)
class FrozenPair:
    hidden: torch.Tensor
    out: torch.Tensor
    scale: float = 2.0


class Outputs(collections.OrderedDict):  # a dict subclass nobody registered
    pass


class Items(list):  # a list subclass carrying an attribute
    pass


NamedPair = collections.namedtuple("NamedPair", ["hidden", "out"])


def _wrap_dataclass(h: torch.Tensor, o: torch.Tensor) -> Any:
    return Pair(h, o, note="kept")


def _wrap_frozen(h: torch.Tensor, o: torch.Tensor) -> Any:
    return FrozenPair(h, o)


def _wrap_dict_subclass(h: torch.Tensor, o: torch.Tensor) -> Any:
    out = Outputs(hidden=h, out=o)
    out.source = "block"
    return out


def _wrap_list_subclass(h: torch.Tensor, o: torch.Tensor) -> Any:
    out = Items([h, o])
    out.source = "block"
    return out


def _wrap_namedtuple(h: torch.Tensor, o: torch.Tensor) -> Any:
    return NamedPair(h, o)


def _wrap_nested(h: torch.Tensor, o: torch.Tensor) -> Any:
    return {"pair": Pair(h, o), "rest": [Outputs(out=o * 2)]}


WRAPS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "dataclass": _wrap_dataclass,
    "frozen_dataclass": _wrap_frozen,
    "dict_subclass": _wrap_dict_subclass,
    "list_subclass": _wrap_list_subclass,
    "namedtuple": _wrap_namedtuple,
    "nested": _wrap_nested,
}


def _region(wrap: Callable[..., Any]) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    def block(x: torch.Tensor, w: torch.Tensor) -> Any:
        return wrap(*_body(x, w))

    return block


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of ``out``, found by hand (not by the flattening under test)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if dataclasses.is_dataclass(out):
        return [t for f in dataclasses.fields(out) for t in _tensors(getattr(out, f.name))]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    return []


def _loss_of(out: Any) -> torch.Tensor:
    return sum((t.pow(2).sum() * (i + 1) for i, t in enumerate(_tensors(out))), torch.zeros(()))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)


@pytest.mark.parametrize("policy", CORE_POLICIES)
@pytest.mark.parametrize("kind", list(WRAPS))
def test_container_outputs_match_reference(engine: Any, kind: str, policy: str) -> None:
    block = _region(WRAPS[kind])
    region = engine.remat(block, policy=policy)
    x, w = _inputs()
    expected = engine.grads(lambda x, w: _loss_of(block(x, w)), x, w)
    actual = engine.grads(lambda x, w: _loss_of(region(x, w)), x, w)
    assert all(bool(g.abs().sum() > 0) for g in expected)
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("kind", list(WRAPS))
def test_container_comes_back_whole(engine: Any, kind: str) -> None:
    block = _region(WRAPS[kind])
    region = engine.remat(block)
    x, w = _inputs()
    seen: list[Any] = []

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = region(x, w)
        seen.append(out)
        return _loss_of(out)

    engine.grads(loss, x, w)
    out, reference = seen[0], block(x, w)
    assert type(out) is type(reference)
    ref_leaves, ref_spec = optree.tree_flatten(reference, namespace="remat")
    leaves, spec = optree.tree_flatten(out, namespace="remat")
    assert spec == ref_spec
    for a, b in zip(leaves, ref_leaves, strict=True):
        if isinstance(b, torch.Tensor):
            assert a.shape == b.shape
        else:
            assert a == b  # non-tensor fields unchanged
    assert getattr(out, "source", None) == getattr(reference, "source", None)


def test_dots_saveable_replays_matmuls_of_a_dataclass_output() -> None:
    # The saved matmuls are replayed, not rerun, when the output is a dataclass.
    region = remat.remat(_region(_wrap_dataclass), policy="dots-saveable")
    x, w = _inputs()
    loss = lambda x, w: _loss_of(region(x, w))  # noqa: E731
    with OpCounter() as counter:
        torch.func.grad(loss, argnums=(0, 1))(x, w)
    forward_mms = 2
    backward_mms = 4  # two per matmul: d/dx and d/dw
    assert counter.counts["mm"] == forward_mms + backward_mms


class Opaque:
    """A plain object holding tensors, not registered anywhere."""

    def __init__(self, hidden: torch.Tensor, out: torch.Tensor) -> None:
        self.hidden = hidden
        self.out = out


class Boxed:
    """Tensors two levels down: in a list attribute."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors


@pytest.mark.parametrize("policy", ("nothing-saveable", "dots-saveable"))
def test_opaque_output_raises_and_registration_fixes_it(engine: Any, policy: str) -> None:
    class Local(Opaque):
        pass

    def block(x: torch.Tensor, w: torch.Tensor) -> Any:
        return Local(*_body(x, w))

    def loss_of(out: Local) -> torch.Tensor:
        return out.hidden.pow(2).sum() + out.out.pow(2).sum()

    region = engine.remat(block, policy=policy)
    x, w = _inputs()
    with pytest.raises(remat.RematError) as info:
        engine.grads(lambda x, w: loss_of(region(x, w)), x, w)
    message = str(info.value)
    assert "block" in message and "test_container_outputs.py" in message
    assert "Local.hidden" in message and "namespace='remat'" in message

    # The fix the message names: register the type in the "remat" namespace.
    optree.register_pytree_node(
        Local,
        lambda o: ((o.hidden, o.out), None),
        lambda _, children: Local(*children),
        namespace="remat",
    )
    expected = engine.grads(lambda x, w: loss_of(block(x, w)), x, w)
    actual = engine.grads(lambda x, w: loss_of(region(x, w)), x, w)
    torch.testing.assert_close(actual, expected)


def test_opaque_output_fix_with_torch_pytree(engine: Any) -> None:
    class Local(Boxed):
        pass

    def block(x: torch.Tensor, w: torch.Tensor) -> Any:
        return Local(list(_body(x, w)))

    def loss_of(out: Local) -> torch.Tensor:
        return sum((t.pow(2).sum() for t in out.tensors), torch.zeros(()))

    region = engine.remat(block)
    x, w = _inputs()
    with pytest.raises(remat.RematError, match=r"Local\.tensors\[0\]"):
        engine.grads(lambda x, w: loss_of(region(x, w)), x, w)
    torch.utils._pytree.register_pytree_node(
        Local, lambda o: (o.tensors, None), lambda children, _: Local(list(children))
    )
    expected = engine.grads(lambda x, w: loss_of(block(x, w)), x, w)
    torch.testing.assert_close(engine.grads(lambda x, w: loss_of(region(x, w)), x, w), expected)


def test_output_holding_a_module_is_not_an_error(engine: Any) -> None:
    # A module's tensors are parameters (region inputs), never region outputs.
    lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def block(x: torch.Tensor, w: torch.Tensor) -> Any:
        return _body(x, w)[1], {"module": lin}

    region = engine.remat(block)
    x, w = _inputs()
    expected = engine.grads(lambda x, w: block(x, w)[0].pow(2).sum(), x, w)
    torch.testing.assert_close(
        engine.grads(lambda x, w: region(x, w)[0].pow(2).sum(), x, w), expected
    )


# -- Hugging Face: ModelOutput is an OrderedDict subclass and a dataclass ------------------


@pytest.mark.parametrize("policy", ("nothing-saveable", "dots-saveable", "save:hidden"))
def test_model_output(engine: Any, policy: str) -> None:
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import BaseModelOutputWithPast

    def block(x: torch.Tensor, w: torch.Tensor) -> Any:
        h, o = _body(x, w)
        return BaseModelOutputWithPast(last_hidden_state=o, hidden_states=(x, h))

    def loss_of(out: Any) -> torch.Tensor:
        assert type(out) is BaseModelOutputWithPast and out.past_key_values is None
        assert list(out.keys()) == ["last_hidden_state", "hidden_states"]
        hidden = out["hidden_states"][1]
        assert hidden is out.hidden_states[1]  # item and attribute stay one tensor
        return out.last_hidden_state.pow(2).sum() + hidden.sin().sum()

    region = engine.remat(block, policy=policy)
    x, w = _inputs()
    expected = engine.grads(lambda x, w: loss_of(block(x, w)), x, w)
    torch.testing.assert_close(engine.grads(lambda x, w: loss_of(region(x, w)), x, w), expected)


def _tiny_gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
    )
    return transformers.GPT2Model(cfg).eval()


@pytest.mark.parametrize("policy", ("nothing-saveable", "dots-saveable"))
@pytest.mark.parametrize("how", ["wrap", "apply"])
def test_gpt2_under_torch_func_grad(how: str, policy: str) -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    base = _tiny_gpt2()
    model = copy.deepcopy(base)
    if how == "wrap":
        model = remat.wrap(model, policy=policy)
    else:
        model = remat.apply(model, policy=policy, where=GPT2Block)
    ids = torch.randint(0, 64, (2, 8))
    params = {k: v.detach() for k, v in base.named_parameters()}

    def loss(m: torch.nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        def inner(p: dict[str, torch.Tensor]) -> torch.Tensor:
            out = torch.func.functional_call(m, p, (ids,), {"use_cache": False})
            return out.last_hidden_state.pow(2).mean()  # type: ignore[no-any-return]

        return inner

    expected = torch.func.grad(loss(base))(params)
    actual = torch.func.grad(loss(model))(params)
    assert set(actual) == set(expected)
    nonzero = [k for k, g in expected.items() if g.abs().sum() > 0]
    assert len(nonzero) > len(expected) // 2
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], msg=key)


def test_opaque_output_of_a_nested_region_raises(engine: Any) -> None:
    # The inner region runs inside the outer one's forward: both engines still check it.
    class Local(Opaque):
        pass

    def inner(x: torch.Tensor, w: torch.Tensor) -> Local:
        return Local(*_body(x, w))

    inner_region = engine.remat(inner)
    outer = engine.remat(lambda x, w: inner_region(x, w).out.sum())
    x, w = _inputs()
    with pytest.raises(remat.RematError, match=r"inner \(.*test_container_outputs.py"):
        engine.grads(outer, x, w)
    optree.register_pytree_node(
        Local,
        lambda o: ((o.hidden, o.out), None),
        lambda _, children: Local(*children),
        namespace="remat",
    )
    expected = engine.grads(lambda x, w: inner(x, w).out.sum(), x, w)
    torch.testing.assert_close(engine.grads(outer, x, w), expected)
