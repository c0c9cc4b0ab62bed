"""Format warm-up: a few supervised steps that teach the answer *format* only — one of the task's valid options
followed by the end-of-answer token — with the option drawn uniformly at random, never the correct answer.

After it, a greedy policy answers with a valid option at about the task's chance level, so the RL reward starts
from chance instead of from the near-zero rate of hitting "option, then end" by sampling the whole vocabulary.
The warmed-up model is saved as a local transformers checkpoint that every service then loads.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from relax_modalities import MediaError
from relax_services.config import RunConfig
from relax_services.data.run_data import WarmupItem
from relax_services.engines import LossInputs, TrainSample
from relax_services.engines.torch import build_train_engine
from relax_services.models import OmniPrompt, copy_side_files
from relax_services.models.policy import build_policy, checkpoint_of
from relax_services.rows import DataItem

__all__ = ["format_warmup"]


def _nll(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    loss = -(inputs.logprobs * inputs.mask).sum() / inputs.mask.sum().clamp(min=1)  # token-mean NLL
    return loss, {"nll": float(loss.detach())}


def format_warmup(
    cfg: RunConfig,
    items: Sequence[WarmupItem],
    to_prompt: Callable[[DataItem], OmniPrompt],
    out_dir: str,
    seed: int = 0,
) -> dict[str, object]:
    """Train ``cfg.trainer.warmup_format_steps`` supervised steps on random valid options; save to ``out_dir``
    as a checkpoint folder (weights, configs, and the source checkpoint's tokenizer and preprocessor config).

    Args:
        items: Training rows with their valid answers (``extra_info.options``); their answers are not used.
        to_prompt: Item → model prompt (the modality data path).
        out_dir: Where the warmed-up checkpoint is written.

    Returns:
        ``{"path", "steps", "nll"}`` (the last step's loss).
    """
    torch.set_num_threads(1)
    ckpt = checkpoint_of(cfg.model)
    tokenizer, eos_id = ckpt.tokenizer, ckpt.tokens.eos_id
    rng = random.Random(seed)
    warm_cfg = cfg.model_copy(
        update={
            # A constant trainer.warmup_lr: the run's LR schedule spans the RL updates (trainer.total_steps), not
            # the warm-up, which would otherwise decay along it (to its floor within a 3-update run).
            "optimizer": cfg.optimizer.model_copy(
                update={"lr": cfg.trainer.warmup_lr, "warmup_steps": 0, "schedule": "constant"}
            ),
            "trainer": cfg.trainer.model_copy(update={"minibatches": 1, "ppo_epochs": 1}),
            # The warm-up's loss has no KL term: its engine scores as a run without one (no whole distributions).
            "algorithm": cfg.algorithm.model_copy(update={"kl_coef": 0.0}),
            # Every weight: the folder it writes is a plain model, the RL run's base (its adapters start there).
            "model": cfg.model.model_copy(update={"lora": None}),
        }
    )
    engine = build_train_engine(warm_cfg, build_policy(cfg.model))
    batch_size = cfg.trainer.micro_batch_groups * cfg.algorithm.group_size
    prompts = []
    for item, options in items:
        try:
            prompts.append((to_prompt(item), options))
        except MediaError:  # a row whose media cannot be read: the feeder skips and counts it, the warm-up skips it
            continue
    metrics: dict[str, float] = {}
    for _ in range(cfg.trainer.warmup_format_steps):
        batch = []
        for prompt, options in rng.sample(prompts, min(batch_size, len(prompts))):
            target = [*tokenizer.encode(rng.choice(options), add_special_tokens=False), eos_id]
            batch.append(TrainSample(prompt=prompt, response_ids=torch.tensor(target)))
        metrics = engine.step(batch, _nll)
    path = Path(out_dir)
    model: Any = engine.model
    model.save_pretrained(path)
    copy_side_files(ckpt.path, path)
    return {"path": str(path), "steps": cfg.trainer.warmup_format_steps, "nll": metrics.get("nll", float("nan"))}
