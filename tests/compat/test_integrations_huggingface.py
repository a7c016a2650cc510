"""`remat.integrations.huggingface` and `remat.apply` on Hugging Face models.

Tiny random-init GPT-2 and Llama in training mode with their default config
(``use_cache`` on, GPT-2's dropout on): each case compares the loss and every
parameter's gradient with the same model without checkpointing (same weights,
inputs and seed), and checks what was recomputed (matmul counts) or kept
(exact CPU bytes).
"""

from __future__ import annotations

import copy
import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import OpCounter
from torch import nn

import remat
import remat.compat

transformers = pytest.importorskip("transformers")
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

from remat.integrations import huggingface  # noqa: E402

VOCAB, SEQ, BATCH = 64, 8, 2
MATMULS = ("mm", "addmm", "bmm", "baddbmm")


def _gpt2(layers: int = 2, dropout: float = 0.1) -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=layers, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama(layers: int = 2, dropout: float = 0.0) -> nn.Module:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attention_dropout=dropout,
    )
    return transformers.LlamaForCausalLM(cfg)


MODELS: dict[str, Callable[..., nn.Module]] = {"gpt2": _gpt2, "llama": _llama}


@functools.cache
def _base(name: str, layers: int = 2, dropout: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name](layers) if dropout else MODELS[name](layers, 0.0)
    return model.train()


def _fresh(name: str, layers: int = 2, dropout: bool = True) -> nn.Module:
    return copy.deepcopy(_base(name, layers, dropout))


IDS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, gradients and backward matmul count of one default training step."""
    torch.manual_seed(1234)
    loss = model(IDS, labels=IDS).loss  # default config: use_cache on
    with OpCounter() as counter:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(counter.counts[op] for op in MATMULS)


@functools.cache
def _reference(name: str, layers: int = 2) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    return _step(_fresh(name, layers))


def _hf_enable(model: nn.Module, **kwargs: Any) -> None:
    """Hugging Face's own checkpointing, through its non-deprecated name where it has one."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False}, **kwargs)
    else:
        model.gradient_checkpointing_enable({"use_reentrant": False}, **kwargs)


def _is_hf_checkpointing(model: nn.Module) -> bool:
    return any(m.__dict__.get("gradient_checkpointing") is True for m in model.modules())


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
@pytest.mark.parametrize("name", MODELS)
def test_default_config_trains_with_the_gradients_of_no_checkpointing(name: str,
                                                                       policy: str) -> None:
    model = huggingface.enable(_fresh(name), policy=policy)
    assert huggingface.checkpointed_layers(model) == [
        n for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)
    ]
    loss, grads, matmuls = _step(model)
    ref_loss, ref_grads, ref_matmuls = _reference(name)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    torch.testing.assert_close(grads, ref_grads)
    if policy == "dots-saveable":
        assert matmuls == ref_matmuls  # every matmul kept: none rerun
    elif policy == "nothing-saveable":
        assert matmuls > ref_matmuls  # each layer's matmuls rerun in backward
    # save-last: the last layer keeps everything, the others rerun
    if policy == "save-last":
        assert ref_matmuls < matmuls < _step(huggingface.enable(_fresh(name)))[2]


def test_plugs_into_the_hugging_face_hook_directly() -> None:
    model = _fresh("gpt2")
    model._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=remat.compat.checkpoint
    )
    loss, grads, matmuls = _step(model)
    ref_loss, ref_grads, ref_matmuls = _reference("gpt2")
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref_grads)
    assert matmuls > ref_matmuls


#: Long enough that activations, not parameter gradients, set the peak.
LONG_IDS = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(2))


def _memory(model: nn.Module) -> remat.MemoryReport:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1234)
    return remat.measure_memory(lambda ids: model(ids, labels=ids).loss, LONG_IDS)


@pytest.mark.parametrize("name", MODELS)
def test_nothing_saveable_peak_is_that_of_hugging_face_checkpointing(name: str) -> None:
    ours = _memory(huggingface.enable(_fresh(name, 3), policy="nothing-saveable"))
    hf_model = _fresh(name, 3)
    _hf_enable(hf_model)
    theirs = _memory(hf_model)
    plain = _memory(_fresh(name, 3))
    # Measured exactly equal (GPT-2: 866,184 B peak, 1,948,296 B without checkpointing;
    # Llama: 456,584 B, 994,824 B), so within the 1.02x bound.
    assert (ours.peak_bytes, ours.held_bytes) == (theirs.peak_bytes, theirs.held_bytes)
    assert ours.peak_bytes < plain.peak_bytes / 2, (ours, plain)


@pytest.mark.parametrize("name", MODELS)
def test_every_n_layers(name: str) -> None:
    model = huggingface.enable(_fresh(name, 4), every_n_layers=2)
    prefix = "transformer.h" if name == "gpt2" else "model.layers"
    assert huggingface.checkpointed_layers(model) == [f"{prefix}.0", f"{prefix}.2"]
    _, grads, matmuls = _step(model)
    _, ref_grads, ref_matmuls = _reference(name, 4)
    _, _, all_matmuls = _step(huggingface.enable(_fresh(name, 4)))
    torch.testing.assert_close(grads, ref_grads)
    # Half the layers rerun: half the extra matmuls of checkpointing every layer.
    assert 2 * (matmuls - ref_matmuls) == all_matmuls - ref_matmuls > 0


def _functional_loss(model: nn.Module) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        output = torch.func.functional_call(model, params, (ids,), {"labels": ids})
        return output.loss  # type: ignore[no-any-return]

    return loss


# torch's vmap has no batching rule for CPU flash attention and says so; not ours.
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("name", MODELS)
def test_torch_func_grad_and_vmap_grad_over_functional_call(name: str) -> None:
    model = huggingface.enable(_fresh(name, 2, dropout=False), policy="dots-saveable")
    plain = _fresh(name, 2, dropout=False)
    params = {n: p.detach() for n, p in model.named_parameters()}
    got = torch.func.grad(_functional_loss(model))(params, IDS)
    expected = torch.func.grad(_functional_loss(plain))(params, IDS)
    torch.testing.assert_close(got, expected)
    per_example = torch.func.vmap(torch.func.grad(_functional_loss(model)), in_dims=(None, 0))
    plain_per_example = torch.func.vmap(torch.func.grad(_functional_loss(plain)),
                                        in_dims=(None, 0))
    ids = IDS[:, None]  # one example of one sequence per vmap lane
    torch.testing.assert_close(per_example(params, ids), plain_per_example(params, ids))


def test_disable_restores_the_model() -> None:
    model = huggingface.disable(huggingface.enable(_fresh("gpt2")))
    assert huggingface.checkpointed_layers(model) == []
    assert not _is_hf_checkpointing(model)
    assert not any(remat.is_wrapped(m) for m in model.modules())
    loss, grads, matmuls = _step(model)
    ref_loss, ref_grads, ref_matmuls = _reference("gpt2")
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref_grads)
    assert matmuls == ref_matmuls  # nothing rerun


def test_enable_replaces_hugging_face_checkpointing_and_the_reverse() -> None:
    model = _fresh("gpt2")
    _hf_enable(model)
    huggingface.enable(model, policy="dots-saveable")
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert all(isinstance(m._gradient_checkpointing_func, huggingface.RematCheckpoint)
               for m in layers)
    _, grads, matmuls = _step(model)
    assert matmuls == _reference("gpt2")[2]  # dots kept: HF's full checkpoint is gone
    torch.testing.assert_close(grads, _reference("gpt2")[1])
    _hf_enable(model)  # Hugging Face's own replaces remat's
    assert huggingface.checkpointed_layers(model) == []
    assert _is_hf_checkpointing(model)


def test_enable_replaces_remat_apply_wrappers() -> None:
    model = remat.apply(_fresh("gpt2"), where=GradientCheckpointingLayer)
    huggingface.enable(model, policy="dots-saveable")
    assert not any(remat.is_wrapped(m) for m in model.modules())
    assert _step(model)[2] == _reference("gpt2")[2]


def test_apply_on_hugging_face_checkpointing_warns_and_the_fix_works() -> None:
    model = _fresh("gpt2")
    _hf_enable(model)
    with pytest.warns(remat.RematWarning, match=r"2 layer\(s\) of type GPT2Block are also "
                      "checkpointed by Hugging Face's own gradient checkpointing"):
        remat.apply(model, policy="dots-saveable")
    # The fixes the message gives: enable() (which replaces), or disable() first.
    fixed = huggingface.enable(model, policy="dots-saveable")
    assert _step(fixed)[2] == _reference("gpt2")[2]
    other = _fresh("gpt2")
    _hf_enable(other)
    huggingface.disable(other)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.apply(other, policy="dots-saveable")
    assert sum(remat.is_wrapped(m) for m in other.modules()) == 2


def test_apply_without_where_wraps_the_declared_layers() -> None:
    model = remat.apply(_fresh("llama", 3), policy="nothing-saveable")
    wrapped = [n for n, m in model.named_modules() if remat.is_wrapped(m)]
    assert wrapped == ["model.layers.0", "model.layers.1", "model.layers.2"]
    torch.manual_seed(1234)
    loss = model(IDS, labels=IDS, use_cache=False).loss
    with OpCounter() as counter:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    reference = _fresh("llama", 3)
    torch.manual_seed(1234)
    reference(IDS, labels=IDS, use_cache=False).loss.backward()
    torch.testing.assert_close(grads, {n: p.grad for n, p in reference.named_parameters()})
    assert sum(counter.counts[op] for op in MATMULS) > _reference("llama", 3)[2]


def test_apply_without_where_on_a_model_that_declares_none_raises_and_the_fix_works() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"Sequential declares no checkpointable layers .* "
                       r"remat.apply\(model, where=MyBlock\)"):
        remat.apply(model)
    remat.apply(model, where=nn.Linear)
    assert [remat.is_wrapped(m) for m in model] == [True, False, True]


def test_hugging_face_checkpointing_off_means_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = remat.apply(_fresh("gpt2"))
    assert sum(remat.is_wrapped(m) for m in model.modules()) == 2


def test_without_transformers_the_message_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="needs transformers: pip install transformers"):
        huggingface.enable(nn.Linear(2, 2))


def test_a_model_without_hugging_face_checkpointing_raises() -> None:
    with pytest.raises(ValueError, match=r"does not support Hugging Face's gradient "
                       r"checkpointing .* remat.apply\(model, where=BlockType, policy=...\)"):
        huggingface.enable(nn.Linear(2, 2))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_every_n_layers_must_be_a_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match="every_n_layers must be a positive int"):
        huggingface.enable(_fresh("gpt2"), every_n_layers=bad)


def test_apply_with_the_default_cache_in_training_raises_naming_use_cache() -> None:
    model = remat.apply(_fresh("gpt2"))
    with pytest.raises(remat.NondeterministicRecomputeError, match="use_cache=False"):
        model(IDS, labels=IDS)
    reference = _fresh("gpt2")
    for m in (model, reference):  # the fix the message gives
        torch.manual_seed(1234)
        m(IDS, labels=IDS, use_cache=False).loss.backward()
    torch.testing.assert_close({n: p.grad for n, p in model.named_parameters()},
                               {n: p.grad for n, p in reference.named_parameters()})
