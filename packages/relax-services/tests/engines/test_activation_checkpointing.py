"""``trainer.activation_checkpointing``: the one-process engine recomputes each decoder block's MLP in the backward
pass. The same update as without it (the recompute runs the same operations on the same inputs), and one update's
peak memory lower by at least the MLP activations the blocks no longer keep (counted from torch's allocation
records, not timed)."""

from __future__ import annotations

from pathlib import Path

import torch

from relax_services.bench.peak_memory import peak_bytes
from relax_services.config import load_run_config
from relax_services.engines import TrainSample
from relax_services.engines.torch import build_train_engine
from relax_services.models import OmniPrompt
from relax_services.models.tiny_families import write_tiny_checkpoint
from relax_services.services.trainer import make_loss_fn

LAYERS, HIDDEN, FFN = 4, 64, 1024
PROMPTS, GROUP, PROMPT_TOKENS, RESPONSE_TOKENS = 2, 4, 16, 240
FLOAT = 4
MLP_SAVED = 3
"""``[tokens, FFN]`` tensors a SwiGLU MLP keeps for its backward at least: the gate projection's output (SiLU's
input), SiLU's output and the up projection's output (the product's two inputs); the product itself, kept for the
down projection's weight gradient, is a fourth left out of the bound."""


def _batch() -> list[TrainSample]:
    gen = torch.Generator().manual_seed(0)
    uniform = torch.full((RESPONSE_TOKENS,), -4.0)
    batch = []
    for _ in range(PROMPTS):
        prompt = OmniPrompt(torch.randint(12, 64, (PROMPT_TOKENS,), generator=gen))
        for j in range(GROUP):
            fields = {"old_logprobs": uniform, "advantages": torch.full((RESPONSE_TOKENS,), j % 2 * 2.0 - 1)}
            batch.append(TrainSample(prompt, torch.randint(12, 64, (RESPONSE_TOKENS,), generator=gen), fields))
    return batch


def _step(folder: Path, checkpointing: bool) -> tuple[int, dict[str, float], dict[str, torch.Tensor]]:
    cfg = load_run_config(
        None,
        [
            f"model.source={folder}",
            "algorithm.kl_coef=0",
            f"algorithm.group_size={GROUP}",
            f"trainer.groups_per_step={PROMPTS}",
            f"trainer.micro_batch_groups={PROMPTS}",
            f"trainer.activation_checkpointing={checkpointing}",
        ],
    )
    engine = build_train_engine(cfg)
    metrics: dict[str, float] = {}
    batch, loss_fn = _batch(), make_loss_fn(cfg)
    peak = peak_bytes(lambda: metrics.update(engine.step(batch, loss_fn)))
    return peak, metrics, {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_checkpointed_blocks_give_the_same_update_in_less_memory(tmp_path: Path) -> None:
    """Without checkpointing every block's MLP activations are alive when the backward starts; with it only the
    MLP being recomputed holds its own. So the peak falls by at least (LAYERS − 1) blocks' worth of the
    ``MLP_SAVED`` ``[tokens, FFN]`` tensors: 3 · 3 · (8 · 256) · 1,024 · 4 B = 75.5 MB."""
    folder = write_tiny_checkpoint(
        tmp_path / "qwen2",
        "qwen2",
        shape={"hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS},
    )
    plain_peak, plain_metrics, plain_weights = _step(folder, False)
    ckpt_peak, ckpt_metrics, ckpt_weights = _step(folder, True)
    assert ckpt_metrics["loss"] == plain_metrics["loss"] and ckpt_metrics["grad_norm"] == plain_metrics["grad_norm"]
    assert plain_weights.keys() == ckpt_weights.keys()
    assert all(torch.equal(plain_weights[k], ckpt_weights[k]) for k in plain_weights)
    tokens = PROMPTS * GROUP * (PROMPT_TOKENS + RESPONSE_TOKENS)
    saved = (LAYERS - 1) * MLP_SAVED * tokens * FFN * FLOAT
    assert plain_peak - ckpt_peak >= saved, (plain_peak, ckpt_peak, saved)
