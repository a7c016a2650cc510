"""Tests for remat.policies: objects, decisions, strings, callables."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import CheckpointPolicy

from remat import policies as P
from remat._policy import strings as _policy_strings
from remat.policies import Decision

aten = torch.ops.aten
MM = aten.mm.default
BMM = aten.bmm.default
RELU = aten.relu.default

S, O, R = Decision.SAVE, Decision.OFFLOAD, Decision.RECOMPUTE  # noqa: E741

VALID = (
    "dots-no-batch-saveable, dots-saveable, dots-with-no-batch-dims-saveable, "
    "everything-saveable, nothing-saveable, offload-dots, offload-dots-no-batch, save-last"
)
PATTERNS = (
    "Name patterns: save:NAMES, save-except:NAMES, everything-except:NAMES, offload:NAMES, "
    "and A+B; memory budgets: budget:0.3 (a fraction) or budget:64MiB."
)


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_policy_strings, "_REGISTRY", dict(_policy_strings._BUILTINS))
    yield


def decide(policy: P.Policy, op: Any, name: str | None = None) -> Decision:
    return policy.decide(policy.decide_op(op, (), {}), name)


# --------------------------------------------------------------------------- strings

STRINGS = [
    ("nothing-saveable", P.nothing_saveable),
    ("everything-saveable", P.everything_saveable),
    ("dots-saveable", P.dots_saveable),
    ("dots-no-batch-saveable", P.dots_with_no_batch_dims_saveable),
    ("dots-with-no-batch-dims-saveable", P.dots_with_no_batch_dims_saveable),
    ("save-last", P.save_last),
    ("offload-dots", P.offload_dots),
    ("offload-dots-no-batch", P.offload_dot_with_no_batch_dims()),
    ("save:a,b", P.save_only_these_names("a", "b")),
    ("save-except:a,b", P.save_any_names_but_these("a", "b")),
    ("everything-except:a,b", P.save_anything_except_these_names("a", "b")),
    ("offload:a,b", P.save_and_offload_only_these_names(names_which_can_be_offloaded=("a", "b"))),
    ("save-last+dots-saveable", P.save_from_both_policies(P.save_last, P.dots_saveable)),
    # underscores, whitespace
    ("nothing_saveable", P.nothing_saveable),
    ("  dots_with_no_batch_dims_saveable ", P.dots_with_no_batch_dims_saveable),
    ("save_except: a , b ", P.save_any_names_but_these("a", "b")),
    ("everything_except:my_name", P.save_anything_except_these_names("my_name")),
    ("save:my-name", P.save_only_these_names("my-name")),
]


@pytest.mark.parametrize(("text", "expected"), STRINGS)
def test_strings(text: str, expected: P.Policy) -> None:
    assert P.resolve(text) == expected


def test_names_keep_underscores_and_hyphens() -> None:
    assert P.resolve("save:a_b") != P.resolve("save:a-b")


def test_plus_with_three_parts_folds_left() -> None:
    p = P.resolve("save:a + dots_saveable+ save-last")
    expected = P.save_from_both_policies(
        P.save_from_both_policies(P.save_only_these_names("a"), P.dots_saveable), P.save_last
    )
    assert p == expected
    assert p.uses_ops and p.uses_names and p.saves_latest_region


def test_add_operator() -> None:
    assert P.dots_saveable + P.save_last == P.save_from_both_policies(P.dots_saveable, P.save_last)
    assert P.dots_saveable + "save:a" == P.resolve("dots-saveable+save:a")
    assert "save:a" + P.dots_saveable == P.resolve("save:a+dots-saveable")
    with pytest.raises(TypeError):
        P.dots_saveable + 3


def test_resolve_policy_returned_as_is() -> None:
    p = P.save_only_these_names("x")
    assert P.resolve(p) is p


def test_unknown_policy_message() -> None:
    with pytest.raises(ValueError) as info:
        P.resolve("dots-savable")
    assert str(info.value) == (
        "remat.policies.resolve: unknown policy 'dots-savable'; did you mean 'dots-saveable'? "
        f"Valid names: {VALID}. {PATTERNS}"
    )


def test_unknown_policy_message_without_suggestion() -> None:
    with pytest.raises(ValueError) as info:
        P.resolve("zzzz")
    assert str(info.value) == (
        f"remat.policies.resolve: unknown policy 'zzzz'; Valid names: {VALID}. {PATTERNS}"
    )


def test_unknown_pattern_keyword() -> None:
    with pytest.raises(ValueError) as info:
        P.resolve("sav:a,b")
    assert str(info.value) == (
        "remat.policies.resolve: unknown policy 'sav:a,b'; did you mean 'save:a,b'? "
        f"Valid names: {VALID}. {PATTERNS}"
    )


def test_unknown_part_of_sum() -> None:
    with pytest.raises(ValueError, match="unknown policy 'save-lsat'; did you mean 'save-last'"):
        P.resolve("dots-saveable+save-lsat")


@pytest.mark.parametrize("text", ["save:", "save: ", "save:a,,b", "offload:a,"])
def test_empty_names(text: str) -> None:
    key = text.partition(":")[0]
    with pytest.raises(ValueError) as info:
        P.resolve(text)
    assert str(info.value) == (
        f"remat.policies.resolve: policy {text.strip()!r} has an empty name; write "
        f"'{key}:NAMES' with one or more comma-separated names, e.g. '{key}:a,b'."
    )


@pytest.mark.parametrize("text", ["dots-saveable+", "+save-last", "a++b", ""])
def test_empty_parts(text: str) -> None:
    with pytest.raises(ValueError) as info:
        P.resolve(text)
    assert str(info.value) == (
        f"remat.policies.resolve: policy {text!r} has an empty part around '+'; write "
        "'A+B' with a policy on each side, e.g. 'save-last+dots-saveable'."
    )


@pytest.mark.parametrize("bad", [None, 3, 1.5, b"dots-saveable"])
def test_resolve_type_error(bad: object) -> None:
    with pytest.raises(TypeError) as info:
        P.resolve(bad)
    assert str(info.value) == (
        "remat.policies.resolve: expected a Policy, a policy name such as 'dots-saveable', "
        "a function fn(op, *args, **kwargs) -> bool | Decision, or a list of aten ops; "
        f"got {bad!r} ({type(bad).__name__})."
    )


# --------------------------------------------------------------------------- registry


def test_names_lists_builtins() -> None:
    assert ", ".join(P.names()) == VALID


def test_register_and_resolve() -> None:
    P.register("My_Policy", "save:attn+dots-saveable")
    assert "My-Policy" in P.names()
    assert P.resolve("My-Policy") == P.resolve("save:attn+dots-saveable")
    assert P.resolve("My_Policy") == P.resolve("My-Policy")
    assert P.resolve("My-Policy+save-last") == P.save_from_both_policies(
        P.resolve("My-Policy"), P.save_last
    )
    with pytest.raises(ValueError, match="unknown policy 'my-policy'; did you mean 'My-Policy'"):
        P.resolve("my-policy")  # names are case-sensitive
    P.register("My-Policy", P.nothing_saveable)  # re-registering a user name is fine
    assert P.resolve("My-Policy") is P.nothing_saveable


def test_register_builtin_needs_override() -> None:
    with pytest.raises(ValueError) as info:
        P.register("dots_saveable", P.nothing_saveable)
    assert str(info.value) == (
        "remat.policies.register: 'dots-saveable' is a built-in policy name; pick another "
        "name, or pass override=True to replace it."
    )
    P.register("dots_saveable", P.nothing_saveable, override=True)
    assert P.resolve("dots-saveable") == P.nothing_saveable


@pytest.mark.parametrize("name", ["", "  ", "a:b", "a+b", "a,b"])
def test_register_bad_name(name: str) -> None:
    with pytest.raises(ValueError) as info:
        P.register(name, P.nothing_saveable)
    assert str(info.value) == (
        f"remat.policies.register: invalid policy name {name!r}; use a non-empty name "
        "without ':', '+' or ',' (they are part of the policy string syntax)."
    )


def test_register_resolves_policy() -> None:
    P.register("mine", [aten.mm])
    assert P.resolve("mine") == P.save_these_ops(aten.mm)
    with pytest.raises(TypeError):
        P.register("mine2", 3)
    with pytest.raises(TypeError):
        P.register(3, P.nothing_saveable)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- objects


def test_aliases() -> None:
    assert P.checkpoint_dots is P.dots_saveable
    assert P.checkpoint_dots_with_no_batch_dims is P.dots_with_no_batch_dims_saveable


REPRS = [
    (P.everything_saveable, "everything_saveable"),
    (P.nothing_saveable, "nothing_saveable"),
    (P.dots_saveable, "dots_saveable"),
    (P.dots_with_no_batch_dims_saveable, "dots_with_no_batch_dims_saveable"),
    (P.offload_dots, "offload_dots"),
    (P.offload_dot_with_no_batch_dims(), "offload_dot_with_no_batch_dims(offload_dst='cpu')"),
    (P.save_last, "save_last"),
    (P.save_only_these_names("b", "a"), "save_only_these_names('a', 'b')"),
    (P.save_any_names_but_these("a"), "save_any_names_but_these('a')"),
    (P.save_anything_except_these_names("a"), "save_anything_except_these_names('a')"),
    (
        P.save_and_offload_only_these_names(
            names_which_can_be_saved=["s"], names_which_can_be_offloaded=["o"]
        ),
        "save_and_offload_only_these_names(names_which_can_be_saved=('s',), "
        "names_which_can_be_offloaded=('o',), offload_dst='cpu')",
    ),
    (
        P.save_from_both_policies(P.save_last, P.dots_saveable),
        "save_from_both_policies(save_last, dots_saveable)",
    ),
    (P.save_these_ops(aten.mm, aten.relu.default), "save_these_ops(aten.mm, aten.relu.default)"),
]


@pytest.mark.parametrize(("policy", "text"), REPRS, ids=[t for _, t in REPRS])
def test_repr(policy: P.Policy, text: str) -> None:
    assert repr(policy) == text


def test_equality_and_hash() -> None:
    a = P.save_only_these_names("a", "b")
    b = P.save_only_these_names("b", "a", "a")
    assert a == b and hash(a) == hash(b)
    assert a != P.save_any_names_but_these("a", "b")
    assert P.offload_dot_with_no_batch_dims("pinned_host") == P.offload_dot_with_no_batch_dims()
    assert P.dots_saveable != P.offload_dots
    policies = {P.resolve(text) for text, _ in STRINGS}
    assert len(policies) == len({repr(p) for p in policies})
    assert P.save_these_ops(aten.mm, aten.relu) == P.resolve([aten.relu, aten.mm])


def test_frozen() -> None:
    with pytest.raises(AttributeError):
        P.save_only_these_names("a").names = ("b",)  # type: ignore[misc]


def test_flags() -> None:
    for p in (P.nothing_saveable, P.everything_saveable, P.save_last):
        assert not p.uses_ops and not p.uses_names and not p.needs_op_trace
    assert P.save_last.saves_latest_region
    assert not P.nothing_saveable.saves_latest_region
    assert P.nothing_saveable.decision_without_ops() is R
    assert P.everything_saveable.decision_without_ops() is S
    assert P.save_last.decision_without_ops() is R
    for p in (P.dots_saveable, P.dots_with_no_batch_dims_saveable, P.offload_dots):
        assert p.uses_ops and not p.uses_names
    for p in (
        P.save_only_these_names("a"),
        P.save_any_names_but_these("a"),
        P.save_anything_except_these_names("a"),
        P.save_and_offload_only_these_names(names_which_can_be_saved=["a"]),
    ):
        assert not p.uses_ops and p.uses_names and p.needs_op_trace
    both = P.save_from_both_policies(P.save_last, P.save_only_these_names("a"))
    assert (both.uses_ops, both.uses_names, both.saves_latest_region) == (False, True, True)


def test_offload_dst() -> None:
    assert P.offload_dot_with_no_batch_dims("pinned_host").offload_dst == "cpu"
    p = P.save_and_offload_only_these_names(offload_dst="pinned_host")
    assert p.offload_dst == "cpu"
    with pytest.raises(ValueError) as info:
        P.offload_dot_with_no_batch_dims("cuda")
    assert str(info.value) == (
        "remat.policies.offload_dot_with_no_batch_dims: unknown offload_dst 'cuda'; use 'cpu' "
        "(or JAX's name 'pinned_host'), which moves values to pinned host memory."
    )
    with pytest.raises(ValueError, match="save_and_offload_only_these_names: unknown offload"):
        P.save_and_offload_only_these_names(offload_dst="device")


def test_save_and_offload_overlap() -> None:
    with pytest.raises(ValueError) as info:
        P.save_and_offload_only_these_names(
            names_which_can_be_saved=["a", "b"], names_which_can_be_offloaded=["b"]
        )
    assert str(info.value) == (
        "remat.policies.save_and_offload_only_these_names: names ['b'] are in both "
        "names_which_can_be_saved and names_which_can_be_offloaded; give each name to one of them."
    )


def test_name_type_errors() -> None:
    with pytest.raises(TypeError) as info:
        P.save_only_these_names("a", 3)  # type: ignore[arg-type]
    assert str(info.value) == (
        "remat.policies.save_only_these_names: names must be strings, got 3 (int)."
    )
    with pytest.raises(TypeError) as info:
        P.save_and_offload_only_these_names(names_which_can_be_saved="ab")
    assert str(info.value) == (
        "remat.policies.save_and_offload_only_these_names: expected a sequence of names, got "
        "the string 'ab'; write ('ab',) for a single name."
    )


def test_save_from_both_type_error() -> None:
    with pytest.raises(TypeError) as info:
        P.save_from_both_policies(P.dots_saveable, "save-last")  # type: ignore[arg-type]
    assert str(info.value) == (
        "remat.policies.save_from_both_policies: expected two Policy objects, got "
        "'save-last' (str); use remat.policies.resolve to make one."
    )


# --------------------------------------------------------------------------- decisions

INPUTS = [(MM, None), (RELU, None), (MM, "a"), (RELU, "a"), (RELU, "b"), (BMM, None)]
# expected decisions for: mm, relu, mm named a, relu named a, relu named b, bmm
DECISIONS = [
    (P.nothing_saveable, [R, R, R, R, R, R]),
    (P.everything_saveable, [S, S, S, S, S, S]),
    (P.save_last, [R, R, R, R, R, R]),
    (P.dots_saveable, [S, R, S, R, R, S]),
    (P.dots_with_no_batch_dims_saveable, [S, R, S, R, R, R]),
    (P.offload_dots, [O, R, O, R, R, O]),
    (P.offload_dot_with_no_batch_dims(), [O, R, O, R, R, R]),
    (P.save_only_these_names("a"), [R, R, S, S, R, R]),
    (P.save_any_names_but_these("a"), [R, R, R, R, S, R]),
    (P.save_anything_except_these_names("a"), [S, S, R, R, S, S]),
    (
        P.save_and_offload_only_these_names(
            names_which_can_be_saved=["b"], names_which_can_be_offloaded=["a"]
        ),
        [R, R, O, O, S, R],
    ),
    (
        P.save_from_both_policies(P.save_anything_except_these_names("a"), P.dots_saveable),
        [S, S, S, R, S, S],
    ),
    (P.resolve("offload:a+dots-no-batch-saveable"), [S, R, S, O, R, R]),
    (P.resolve("save-last+dots-saveable"), [S, R, S, R, R, S]),
    (P.save_these_ops(aten.relu), [R, S, R, S, S, R]),
    (P.save_these_ops(aten.mm.default), [S, R, S, R, R, R]),
]


@pytest.mark.parametrize(("policy", "expected"), DECISIONS, ids=[repr(p) for p, _ in DECISIONS])
def test_decisions(policy: P.Policy, expected: list[Decision]) -> None:
    got = [decide(policy, op, name) for op, name in INPUTS]
    assert got == expected


def test_constant_policies_accept_none_op() -> None:
    for p in (P.nothing_saveable, P.everything_saveable, P.save_last):
        assert p.decide(p.decide_op(None, (), {}), None) is p.decision_without_ops()


def test_verdicts_are_hashable() -> None:
    p = P.resolve("everything-except:a+dots-saveable+offload:b")
    v = p.decide_op(MM, (), {})
    hash(v)
    assert v == ((S, S), R)


# --------------------------------------------------------------------------- callables


def test_from_callable_bool_and_decision() -> None:
    seen: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def fn(op: Any, *args: Any, **kwargs: Any) -> bool | Decision:
        seen.append((op, args, kwargs))
        if op == RELU:
            return Decision.OFFLOAD
        return op == MM

    p = P.from_callable(fn)
    assert p.uses_ops and not p.uses_names
    x = torch.ones(1)
    assert p.decide(p.decide_op(MM, (x, x), {"k": 1}), "a") is S
    assert seen[-1] == (MM, (x, x), {"k": 1})
    assert decide(p, BMM) is R
    assert decide(p, RELU) is O
    assert P.resolve(fn) == p and hash(P.resolve(fn)) == hash(p)
    assert P.from_callable(lambda op: True) != P.from_callable(lambda op: True)
    assert repr(p) == f"from_callable({fn.__qualname__})"


def test_from_callable_bad_return() -> None:
    def fn(op: Any, *args: Any, **kwargs: Any) -> Any:
        return 1

    p = P.from_callable(fn)
    with pytest.raises(TypeError) as info:
        p.decide_op(MM, (), {})
    assert str(info.value) == (
        f"remat.policies.from_callable: policy function {fn.__qualname__} returned 1 (int) for "
        "aten.mm.default; it must return a bool (True to save) or a remat.policies.Decision."
    )


def test_from_callable_not_callable() -> None:
    with pytest.raises(TypeError, match=r"from_callable: expected a function .* got 3 \(int\)"):
        P.from_callable(3)  # type: ignore[arg-type]


def test_op_list_forms() -> None:
    assert P.resolve([aten.mm]) == P.save_these_ops(aten.mm)
    assert P.resolve((aten.mm,)) == P.save_these_ops(aten.mm)
    assert P.resolve({aten.mm}) == P.save_these_ops(aten.mm)
    assert decide(P.resolve([aten.mm]), aten.mm.out) is S
    with pytest.raises(TypeError) as info:
        P.resolve([aten.mm, "relu"])
    assert str(info.value) == (
        "remat.policies.save_these_ops: expected aten ops such as torch.ops.aten.mm or "
        "torch.ops.aten.mm.default, got 'relu' (str)."
    )


SAC_TABLE = [
    (CheckpointPolicy.MUST_SAVE, S),
    (CheckpointPolicy.PREFER_SAVE, S),
    (CheckpointPolicy.MUST_RECOMPUTE, R),
    (CheckpointPolicy.PREFER_RECOMPUTE, R),
    (True, S),
    (False, R),
]
if hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD"):
    SAC_TABLE.append((CheckpointPolicy.MUST_CPU_OFFLOAD, O))


@pytest.mark.parametrize(("answer", "expected"), SAC_TABLE, ids=str)
def test_from_selective_checkpoint(answer: Any, expected: Decision) -> None:
    calls: list[Any] = []

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((ctx.is_recompute, op, args, kwargs))
        return answer

    p = P.from_selective_checkpoint(policy_fn)
    assert p.uses_ops
    assert p.decide(p.decide_op(MM, (1,), {"k": 2}), None) is expected
    assert calls == [(False, MM, (1,), {"k": 2})]
    assert p == P.from_selective_checkpoint(policy_fn)
    assert p != P.from_callable(policy_fn)


def test_from_selective_checkpoint_bad_return() -> None:
    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return "save"

    p = P.from_selective_checkpoint(policy_fn)
    with pytest.raises(TypeError) as info:
        p.decide_op(RELU, (), {})
    assert str(info.value) == (
        f"remat.policies.from_selective_checkpoint: policy function {policy_fn.__qualname__} "
        "returned 'save' (str) for aten.relu.default; it must return a "
        "torch.utils.checkpoint.CheckpointPolicy or a bool."
    )


# --------------------------------------------------------------------------- properties

BASE_POLICIES = [p for p, _ in DECISIONS]
OPS = [None, MM, BMM, RELU, aten.addmm.default, aten.convolution.default, aten.add.Tensor]
NAMES = [None, "a", "b", "c"]

policy_st = st.recursive(
    st.sampled_from(BASE_POLICIES),
    lambda inner: st.tuples(inner, inner).map(lambda ab: P.save_from_both_policies(*ab)),
    max_leaves=4,
)


@settings(deadline=None, max_examples=200)
@given(policy_st, policy_st, st.sampled_from(OPS), st.sampled_from(NAMES))
def test_save_from_both_is_max_and_commutative(
    a: P.Policy, b: P.Policy, op: Any, name: str | None
) -> None:
    ab = P.save_from_both_policies(a, b)
    ba = P.save_from_both_policies(b, a)
    expected = max(decide(a, op, name), decide(b, op, name))
    assert decide(ab, op, name) == expected
    assert decide(ba, op, name) == expected
    either = a.saves_latest_region or b.saves_latest_region
    assert ab.saves_latest_region == ba.saves_latest_region == either
    assert ab.uses_ops == (a.uses_ops or b.uses_ops)
    assert ab.uses_names == (a.uses_names or b.uses_names)
