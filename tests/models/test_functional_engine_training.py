"""A tiny GPT-2 trained with AdamW under ``engine="functional"`` and ``loss.backward()``.

Every step's gradients (None where no remat's are None) and the parameters after
3 steps equal no remat's; each block's region recomputes in backward.
"""

from __future__ import annotations

import pytest
import torch
from helpers import RecomputeCounter

import remat

transformers = pytest.importorskip("transformers")


def _train(policy: str | None) -> tuple[torch.nn.Module, list[list[torch.Tensor | None]],
                                        RecomputeCounter]:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0,
                                     embd_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if policy is not None:
        remat.apply(model, policy=policy, engine="functional")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    grads: list[list[torch.Tensor | None]] = []
    counter = RecomputeCounter()
    for step in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        with counter:
            model(ids, labels=ids).loss.backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
    return model, grads, counter


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last"])
def test_gpt2_adamw_three_steps_under_the_torch_func_engine_match_no_remat(policy: str) -> None:
    ref, ref_grads, _ = _train(None)
    got, got_grads, counter = _train(policy)
    for step, (r, g) in enumerate(zip(ref_grads, got_grads, strict=True)):
        for (name, _), a, b in zip(ref.named_parameters(), r, g, strict=True):
            assert (a is None) == (b is None), f"step {step}: {name}"
            if a is not None and b is not None:
                torch.testing.assert_close(b, a, msg=f"step {step}: {name}")
    for (name, p), q in zip(ref.named_parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    if policy == "save-last":  # the first block is demoted by the second: it recomputes
        assert counter.counts["addmm"] > 0, counter.counts
    elif policy == "dots-saveable":
        assert counter.counts["addmm"] == 0 and sum(counter.counts.values()) > 0
    else:
        assert counter.counts["addmm"] > 0 and counter.counts["tanh"] > 0, counter.counts
