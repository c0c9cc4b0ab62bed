"""``trainer.activation_checkpointing``: the one-process engine recomputes each decoder block (attention and MLP) in
the backward pass. The same update as without it (the recompute runs the same operations on the same inputs, the
attention on the same cached prompt keys: :class:`~relax_services.engines.scoring.ReplayableCache`), every block's
attention run a second time, and one update's peak memory lower by at least the MLP activations the blocks no
longer keep (counted from torch's allocation records, not timed)."""

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


def _step(
    folder: Path, checkpointing: bool, packing: bool = False
) -> tuple[int, dict[str, float], dict[str, torch.Tensor], int]:
    """One update: its peak bytes, metrics, the weights after it and how many times a block's attention ran."""
    cfg = load_run_config(
        None,
        [
            f"model.source={folder}",
            "algorithm.kl_coef=0",
            f"algorithm.group_size={GROUP}",
            f"trainer.groups_per_step={PROMPTS}",
            f"trainer.micro_batch_groups={PROMPTS}",
            f"trainer.activation_checkpointing={checkpointing}",
            f"trainer.packing={packing}",
        ],
    )
    engine = build_train_engine(cfg)
    metrics: dict[str, float] = {}
    batch, loss_fn = _batch(), make_loss_fn(cfg)
    calls = [0]
    for name, module in engine.model.named_modules():
        if name.endswith(".self_attn"):
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    peak = peak_bytes(lambda: metrics.update(engine.step(batch, loss_fn)))
    return peak, metrics, {k: v.detach().clone() for k, v in engine.model.state_dict().items()}, calls[0]


def test_checkpointed_blocks_give_the_same_update_in_less_memory(tmp_path: Path) -> None:
    """Without checkpointing every block's MLP activations are alive when the backward starts; with it only the
    MLP being recomputed holds its own. So the peak falls by at least (LAYERS − 1) blocks' worth of the
    ``MLP_SAVED`` ``[tokens, FFN]`` tensors: 3 · 3 · (8 · 256) · 1,024 · 4 B = 75.5 MB."""
    folder = write_tiny_checkpoint(
        tmp_path / "qwen2",
        "qwen2",
        shape={"hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS},
    )
    plain_peak, plain_metrics, plain_weights, plain_calls = _step(folder, False)
    ckpt_peak, ckpt_metrics, ckpt_weights, ckpt_calls = _step(folder, True)
    assert plain_calls == 2 * LAYERS  # one micro-batch: the prompts' forward and the responses'
    assert ckpt_calls == 2 * plain_calls  # and each once more in the backward
    assert ckpt_metrics["loss"] == plain_metrics["loss"] and ckpt_metrics["grad_norm"] == plain_metrics["grad_norm"]
    assert plain_weights.keys() == ckpt_weights.keys()
    assert all(torch.equal(plain_weights[k], ckpt_weights[k]) for k in plain_weights)
    tokens = PROMPTS * GROUP * (PROMPT_TOKENS + RESPONSE_TOKENS)
    saved = (LAYERS - 1) * MLP_SAVED * tokens * FFN * FLOAT
    assert plain_peak - ckpt_peak >= saved, (plain_peak, ckpt_peak, saved)


def test_packed_responses_recompute_to_the_same_update(tmp_path: Path) -> None:
    """With ``trainer.packing`` the responses run as one packed row after the prompts laid end to end (a second
    cache built from the prompts'): recomputing the blocks gives the packed, uncheckpointed update exactly."""
    folder = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2", shape={"num_hidden_layers": 2})
    _, packed_metrics, packed_weights, _ = _step(folder, False, packing=True)
    _, ckpt_metrics, ckpt_weights, calls = _step(folder, True, packing=True)
    assert calls == 2 * 2 * 2
    assert ckpt_metrics["loss"] == packed_metrics["loss"]
    assert all(torch.equal(packed_weights[k], ckpt_weights[k]) for k in packed_weights)
