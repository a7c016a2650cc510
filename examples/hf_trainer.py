"""Hugging Face ``Trainer`` with remat: one call before training.

``remat.integrations.huggingface.enable(model, policy=...)`` checkpoints the
model's layers with remat through Hugging Face's own checkpointing layers.
Leave the Trainer's own checkpointing flag (``gradient_checkpointing``, renamed
``activation_checkpointing`` in recent transformers) off: turning it on
makes the Trainer install Hugging Face's own checkpointing, which replaces
remat's (never both).

A tiny random-init GPT-2 trains a few steps on random tokens (no downloads),
once with remat and once without checkpointing; the losses are the same.

Run with ``python examples/hf_trainer.py``.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import transformers

from remat.integrations import huggingface


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, each its own label (causal language modelling)."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(policy: str | None, small: bool) -> dict[str, Any]:
    """Train a few steps; return the losses and the layers remat checkpointed."""
    layers, width, length = (2, 32, 16) if small else (6, 256, 128)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=128, n_positions=length,
        bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if policy is not None:
        huggingface.enable(model, policy=policy)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=2 if small else 20, per_device_train_batch_size=4,
            learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        )  # its own checkpointing flag stays at its default, off: remat's is on
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=RandomTokens(64, length, 128)
        )
        trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return {"losses": losses, "checkpointed": huggingface.checkpointed_layers(model)}


def main(small: bool = False) -> dict[str, Any]:
    """Train with remat's ``dots-saveable`` and without checkpointing.

    Args:
        small (bool, optional): use tiny sizes (for the test suite). Default: False.

    Returns:
        dict: ``remat`` and ``plain`` runs, each with ``losses`` (per step) and
        ``checkpointed`` (the layer names remat checkpoints).
    """
    result = {"remat": train("dots-saveable", small), "plain": train(None, small)}
    for name, run in result.items():
        print(f"{name}: losses {run['losses']}, {len(run['checkpointed'])} layers checkpointed")
    return result


if __name__ == "__main__":
    main()
