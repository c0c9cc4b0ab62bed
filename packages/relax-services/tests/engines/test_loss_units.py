"""Micro-batches combine exactly when masked IS removes a different number of tokens or sequences from each.

The reference is the same batch as ONE micro-batch (one call of the loss over the whole batch, nothing to
combine); splitting it into micro-batches must give the same gradient and loss for every aggregation mode and
masked-IS level. With static weights (each micro-batch's share of response tokens or samples, the engine's
``loss_weighting``) it does not: the loss of a micro-batch whose tokens masked IS rejected is a mean over fewer
units than its weight says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_services.config import load_run_config
from relax_services.engines import LossInputs, LossResult, TorchTrainEngine, TrainSample
from relax_services.engines.torch import build_train_engine
from relax_services.models import text_prompt
from relax_services.models.tiny_families import write_tiny_checkpoint
from relax_services.services.trainer import make_loss_fn

GROUPS, GROUP_SIZE = 4, 2


def _samples(engine: TorchTrainEngine) -> list[TrainSample]:
    """Samples whose behaviour log-probs are the trainer's plus noise large enough that masked IS at
    [0.5, 2] rejects some tokens (and, at sequence level, some sequences) — a different share per micro-batch."""
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for g in range(GROUPS):
        prompt = text_prompt(torch.randint(10, 40, (3 + g,), generator=gen).tolist())
        for j in range(GROUP_SIZE):
            prompts.append(prompt)
            responses.append(torch.randint(10, 40, (2 + (3 * g + j) % 5,), generator=gen))
    plain = [TrainSample(p, r) for p, r in zip(prompts, responses, strict=True)]
    trainer_lp, _ = engine.compute_logprobs(plain)
    noise = torch.randn(trainer_lp.shape, generator=gen) * torch.linspace(0.1, 1.5, len(plain)).unsqueeze(1)
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = len(r)
        fields = {
            "old_logprobs": trainer_lp[i, :n] + noise[i, :n],
            "proximal_logprobs": trainer_lp[i, :n],
            "advantages": torch.full((n,), float((-1) ** i) * (1 + i / 4)),
        }
        out.append(TrainSample(p, r, fields))
    return out


def _cfg(folder: Path, micro_groups: int, agg: str, mis: str) -> object:
    return load_run_config(
        None,
        [
            f"model.source={folder}",
            f"trainer.groups_per_step={GROUPS}",
            f"trainer.micro_batch_groups={micro_groups}",
            "trainer.minibatches=2",  # several optimizer steps: the proximal log-probs are a field, as in a run
            f"algorithm.group_size={GROUP_SIZE}",
            f"algorithm.loss_agg_mode={agg}",
            "algorithm.loss_norm_constant=8.0",
            "algorithm.decoupled=true",
            f"algorithm.mis_level={mis}",
            "algorithm.kl_coef=0.0",
            "algorithm.entropy_coef=0.01",
        ],
    )


def _gradients(cfg: object, loss_fn: object = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    engine = build_train_engine(cfg)  # type: ignore[arg-type]
    metrics = engine.accumulate_gradients(_samples(engine), loss_fn or make_loss_fn(cfg))  # type: ignore[arg-type]
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
    return grads, metrics


@pytest.mark.parametrize("mis", ["token", "sequence"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_one_batch_gradient_under_masked_is(tmp_path: Path, agg: str, mis: str) -> None:
    folder = write_tiny_checkpoint(tmp_path / "q2", "qwen2")
    whole, whole_metrics = _gradients(_cfg(folder, GROUPS, agg, mis))
    split, split_metrics = _gradients(_cfg(folder, 1, agg, mis))
    assert 0.05 < whole_metrics["is_masked_frac"] < 0.95  # masked IS did reject part of the batch
    assert whole.keys() == split.keys()
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-4, msg=name)
    assert split_metrics["loss"] == pytest.approx(whole_metrics["loss"], rel=1e-5, abs=1e-7)


def test_a_loss_that_mixes_forms_is_refused(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path / "q2", "qwen2")
    calls = []

    def mixed(inputs: LossInputs) -> torch.Tensor | LossResult:
        calls.append(1)
        loss = -(inputs.logprobs * inputs.mask).sum() / inputs.mask.sum()
        return loss if len(calls) % 2 else LossResult(loss, float(inputs.mask.sum()))

    with pytest.raises(ValueError, match="LossResult for some micro-batches and a plain loss for others"):
        _gradients(_cfg(folder, 1, "token-mean", "token"), mixed)
