"""Remat on real Hugging Face models: tiny random-init GPT-2, Llama, Mixtral, BERT, LoRA.

Every decoder layer is rematerialized with `remat.apply(model, where=GradientCheckpointingLayer)`.
Each case compares the loss and every trainable parameter's gradient with the
same model without remat (same weights, inputs and RNG seed), both in eager
autograd (``loss.backward()``) and under ``torch.func.grad`` over
``torch.func.functional_call``, and checks that remat actually recomputed the
layers' matmuls in backward (or replayed them, for ``dots-saveable``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import OpCounter
from torch import nn

import remat
from remat._inspect.memory import MemoryMeter

transformers = pytest.importorskip("transformers")
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

VOCAB, SEQ, BATCH, HIDDEN = 64, 8, 2, 32
#: Matmul-like aten ops (what ``dots-saveable`` keeps and ``nothing-saveable`` reruns).
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_attention_math")
#: The name the name policy keeps: each layer's MLP output, tagged by a forward hook.
NAME = "mlp_out"
HF_POLICIES = ("nothing-saveable", "dots-saveable", "save-last", f"save:{NAME}")


@dataclasses.dataclass
class Case:
    """A model, its inputs, and how to get a scalar loss out of its output."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: The submodule of each layer whose output the name policy keeps.
    mlp: str

    def loss(self, output: Any) -> torch.Tensor:
        return output.loss  # type: ignore[no-any-return]

    def trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}


def _ids(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def _gpt2() -> Case:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=HIDDEN, n_head=2, vocab_size=VOCAB, n_positions=32,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    ids = _ids(1)
    model = transformers.GPT2LMHeadModel(cfg)
    return Case(model, (ids,), {"labels": ids, "use_cache": False}, "mlp")


def _llama_config() -> Any:
    return transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )


def _llama() -> Case:
    ids = _ids(2)
    model = transformers.LlamaForCausalLM(_llama_config())
    return Case(model, (ids,), {"labels": ids, "use_cache": False}, "mlp")


def _mixtral() -> Case:
    cfg = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5,
        output_router_logits=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    ids = _ids(3)
    model = transformers.MixtralForCausalLM(cfg)
    kwargs = {"labels": ids, "use_cache": False, "output_router_logits": True}
    return Case(model, (ids,), kwargs, "mlp")


def _bert() -> Case:
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, pad_token_id=0,
    )
    ids = _ids(4)
    labels = torch.where(torch.arange(SEQ) % 3 == 0, ids, torch.full_like(ids, -100))
    model = transformers.BertForMaskedLM(cfg)
    return Case(model, (ids,), {"labels": labels}, "output")


def _lora() -> Case:
    peft = pytest.importorskip("peft")
    ids = _ids(5)
    base = transformers.LlamaForCausalLM(_llama_config())
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with warnings.catch_warnings():
        # peft 0.21 calls a transformers 5 alias that warns it is deprecated; not ours.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        model = peft.get_peft_model(base, config)
    # LoRA's B starts at zero, which would make A's gradient zero: give B weights.
    for name, p in model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                p.normal_(0, 0.1)
    return Case(model, (ids,), {"labels": ids, "use_cache": False}, "mlp")


BUILDERS: dict[str, Callable[[], Case]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "mixtral": _mixtral,
    "bert": _bert,
    "lora": _lora,
}


@functools.cache
def _base(name: str) -> Case:
    torch.manual_seed(0)
    case = BUILDERS[name]()
    case.model.train()
    return case


def _fresh(name: str) -> Case:
    """A copy of the model's base case (same weights), free to wrap and differentiate."""
    base = _base(name)
    case = Case(copy.deepcopy(base.model), base.args, base.kwargs, base.mlp)
    _tag_mlp_outputs(case)
    return case


@dataclasses.dataclass
class Run:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    #: Aten op counts of the backward pass (eager) or the whole ``grad`` call (functional).
    counts: dict[str, int]

    def matmuls(self) -> int:
        return sum(self.counts.get(op, 0) for op in MATMULS)


def _eager(case: Case) -> Run:
    params = case.trainable()
    torch.manual_seed(1234)
    loss = case.loss(case.model(*case.args, **case.kwargs))
    with OpCounter() as counter:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    return Run(loss.detach(), grads, dict(counter.counts))


def _functional(case: Case) -> Run:
    params = {n: p.detach() for n, p in case.trainable().items()}

    def loss_fn(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        output = torch.func.functional_call(case.model, p, case.args, case.kwargs)
        loss = case.loss(output)
        return loss, loss.detach()

    torch.manual_seed(1234)
    with OpCounter() as counter:
        grads, loss = torch.func.grad(loss_fn, has_aux=True)(params)
    return Run(loss, dict(grads), dict(counter.counts))


WAYS: dict[str, Callable[[Case], Run]] = {"eager": _eager, "functional": _functional}


@functools.cache
def _reference(name: str, way: str) -> Run:
    return WAYS[way](_fresh(name))


def _tag_mlp_outputs(case: Case) -> None:
    """Tag each layer's MLP output with `checkpoint_name`, so a name policy has a name to keep."""

    def tag(module: nn.Module, args: Any, output: Any) -> Any:
        return remat.checkpoint_name(output, NAME)

    for layer in _layers(case.model):
        layer.get_submodule(case.mlp).register_forward_hook(tag)


def _layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _enter(counter: OpCounter, *_: Any) -> None:
    counter.__enter__()


def _exit(counter: OpCounter, *_: Any) -> None:
    counter.__exit__(None, None, None)


@functools.cache
def _layer_matmuls(name: str) -> tuple[int, ...]:
    """Matmul ops each decoder layer runs in one forward, without remat."""
    case = _fresh(name)
    counters = []
    for layer in _layers(case.model):
        counter = OpCounter()
        # Hooks that return None: the counter runs exactly while the layer does.
        layer.register_forward_pre_hook(functools.partial(_enter, counter))
        layer.register_forward_hook(functools.partial(_exit, counter))
        counters.append(counter)
    torch.manual_seed(1234)
    case.model(*case.args, **case.kwargs)
    return tuple(sum(c.counts.get(op, 0) for op in MATMULS) for c in counters)


def _assert_recomputed(policy: str, run: Run, reference: Run, per_layer: tuple[int, ...]) -> None:
    """Backward reran the matmuls the policy drops, and only those."""
    extra = run.matmuls() - reference.matmuls()
    if policy == "dots-saveable":
        assert extra == 0, f"dots-saveable reran {extra} matmuls; they are kept"
    elif policy == "save-last":
        # The last layer keeps everything; the others rerun (some of) their matmuls.
        assert 0 < extra <= sum(per_layer[:-1]), (extra, per_layer)
    else:
        assert sum(per_layer[:-1]) < extra <= sum(per_layer), (extra, per_layer)


def _assert_same(run: Run, reference: Run) -> None:
    torch.testing.assert_close(run.loss, reference.loss, rtol=1e-5, atol=1e-6)
    assert run.grads.keys() == reference.grads.keys()
    for name, grad in reference.grads.items():
        torch.testing.assert_close(
            run.grads[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


# -- every decoder layer a region -------------------------------------------------

def _layer_cases() -> list[Any]:
    cases = []
    for model in sorted(BUILDERS):
        for policy in HF_POLICIES:
            for way in sorted(WAYS):
                cases.append(pytest.param(model, policy, way))
    return cases


@pytest.mark.parametrize(("model", "policy", "way"), _layer_cases())
def test_layer_remat_matches_no_remat(model: str, policy: str, way: str) -> None:
    case = _fresh(model)
    remat.apply(case.model, policy=policy, where=GradientCheckpointingLayer)
    assert len(_layers(case.model)) == 2 and all(remat.is_wrapped(m) for m in _layers(case.model))
    run = WAYS[way](case)
    reference = _reference(model, way)
    _assert_same(run, reference)
    _assert_recomputed(policy, run, reference, _layer_matmuls(model))


def test_bert_dropout_is_active() -> None:
    """The BERT cases would not test mask replay if dropout did nothing."""
    case = _fresh("bert")
    losses = []
    for seed in (1234, 1234, 99):
        torch.manual_seed(seed)
        losses.append(case.loss(case.model(*case.args, **case.kwargs)).item())
    assert losses[0] == losses[1] != losses[2]


@pytest.mark.parametrize("model", ["gpt2", "llama"])  # the meters are slow: two models
def test_layer_remat_holds_less_memory(model: str) -> None:
    """Eager: bytes held for backward after the forward; torch.func: peak of the grad call."""
    held: dict[str, int] = {}
    peak: dict[str, int] = {}
    for policy in ("none", "nothing-saveable", "dots-saveable", "save-last"):
        case = _fresh(model)
        if policy != "none":
            remat.apply(case.model, policy=policy, where=GradientCheckpointingLayer)
        torch.manual_seed(1234)
        report = remat.measure_memory(lambda c=case: c.loss(c.model(*c.args, **c.kwargs)))
        held[policy] = report.held_bytes
        if policy in ("none", "nothing-saveable"):
            params = {n: p.detach() for n, p in case.trainable().items()}
            with MemoryMeter() as meter:
                torch.func.grad(lambda q, c=case: c.loss(
                    torch.func.functional_call(c.model, q, c.args, c.kwargs)))(params)
            peak[policy] = meter.peak
    assert held["nothing-saveable"] < min(held["dots-saveable"], held["save-last"]), held
    assert max(held["dots-saveable"], held["save-last"]) < held["none"], held
    assert peak["nothing-saveable"] < peak["none"], peak


# -- other ways to place regions and call the models -------------------------------


def _run_variant(
    model: str, way: str, kwargs: dict[str, Any], where: Any,
    loss: Callable[[Any], torch.Tensor] | None = None, attn: str | None = None,
) -> tuple[Run, Run, Case]:
    """(remat, reference, remat case) of ``model`` called with extra ``kwargs``."""
    runs = []
    for rematerialize in (True, False):
        case = _fresh(model)
        case.kwargs = {**case.kwargs, **kwargs}
        if attn is not None:
            case.model.set_attn_implementation(attn)
        if loss is not None:
            case.loss = loss  # type: ignore[method-assign]
        if rematerialize:
            remat.apply(case.model, policy="nothing-saveable", where=where)
            remat_case = case
        runs.append(WAYS[way](case))
    return runs[0], runs[1], remat_case


@pytest.mark.parametrize(
    "way", sorted(WAYS)
)
@pytest.mark.parametrize("model", ["gpt2", "llama", "bert"])
def test_whole_model_as_one_region(model: str, way: str) -> None:
    run, reference, case = _run_variant(model, way, {}, lambda name, _: name == "")
    assert remat.is_wrapped(case.model)
    _assert_same(run, reference)


def _attention_loss(output: Any) -> torch.Tensor:
    return output.loss + sum(a.pow(2).sum() for a in output.attentions)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "way", sorted(WAYS)
)
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_attention_weights_in_the_loss(model: str, way: str) -> None:
    run, reference, _ = _run_variant(
        model, way, {"output_attentions": True}, GradientCheckpointingLayer,
        loss=_attention_loss, attn="eager",
    )
    _assert_same(run, reference)


def _hidden_states_loss(output: Any) -> torch.Tensor:
    return output.loss + sum(h.pow(2).mean() for h in output.hidden_states)  # type: ignore[no-any-return]


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("model", ["gpt2", "llama", "bert"])
def test_hidden_states_in_the_loss(model: str, way: str) -> None:
    """Hidden states are layer outputs (recorded outside the regions): they work."""
    run, reference, _ = _run_variant(
        model, way, {"output_hidden_states": True}, GradientCheckpointingLayer,
        loss=_hidden_states_loss,
    )
    _assert_same(run, reference)


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_kv_cache_in_a_region_is_loud(model: str, way: str) -> None:
    """A layer that writes a KV cache raises, names the layer and says to pass use_cache=False."""
    case = _fresh(model)
    case.kwargs = {**case.kwargs, "use_cache": True}
    remat.apply(case.model, policy="nothing-saveable", where=GradientCheckpointingLayer)
    with pytest.raises(remat.RematError) as info:
        WAYS[way](case)
    message = str(info.value)
    assert type(_layers(case.model)[0]).__name__ in message, message
    assert "use_cache=False" in message, message
    # The fix the message gives: no cache in training.
    case.kwargs["use_cache"] = False
    _assert_same(WAYS[way](case), _reference(model, way))
