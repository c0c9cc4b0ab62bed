"""The rollout/trainer mismatch KL per update (``rollout_mismatch_kl``): the k3 estimate over the tokens sampled
by the trainer's pre-update weights, of the rollout's behaviour log-probs against the trainer's own.

The reference is computed here from the training engine's ``compute_logprobs`` (the pre-update weights) and the
behaviour log-probs the test wrote, pooled over every counted token of the update: the metric must equal it
whatever the micro-batching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_services.config import load_run_config
from relax_services.engines import TrainSample
from relax_services.engines.torch import build_train_engine
from relax_services.models import text_prompt
from relax_services.models.tiny_families import write_tiny_checkpoint
from relax_services.services._mismatch import mismatch_sums, pop_rollout_mismatch
from relax_services.services.trainer import build_train_samples, make_loss_fn

VERSION = 3  # the trainer's version before the update


def _rows(n_groups: int, group_size: int) -> list[dict[str, object]]:
    """Rows with mixed token versions (some at VERSION, some older) and rewards that differ within each group."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for g in range(n_groups):
        prompt = text_prompt(torch.randint(10, 40, (3 + g,), generator=gen).tolist())
        for j in range(group_size):
            length = 2 + (g + j) % 4
            versions = [VERSION - ((g + j + t) % 3 == 0) for t in range(length)]  # VERSION or VERSION - 1
            rows.append(
                {
                    "prompt": prompt,
                    "meta": {"prompt_key": f"p{g}", "task": "text", "answer": "1"},
                    "response": torch.randint(10, 40, (length,), generator=gen).tolist(),
                    "logprobs": [0.0] * length,  # replaced below
                    "token_versions": versions,
                    "reward": float(j % 2),
                    "reward_error": None,
                }
            )
    return rows


@pytest.mark.parametrize(("micro_groups", "agg"), [(4, "token-mean"), (1, "token-mean"), (1, "seq-mean-token-mean")])
def test_update_reports_the_pooled_k3_over_current_version_tokens(tmp_path: Path, micro_groups: int, agg: str) -> None:
    folder = write_tiny_checkpoint(tmp_path / "q2", "qwen2")
    cfg = load_run_config(
        None,
        [
            f"model.source={folder}",
            "trainer.groups_per_step=4",
            f"trainer.micro_batch_groups={micro_groups}",
            "algorithm.group_size=2",
            f"algorithm.loss_agg_mode={agg}",
            "algorithm.kl_coef=0.0",
        ],
    )
    engine = build_train_engine(cfg)
    rows = _rows(4, 2)
    plain = [TrainSample(prompt=r["prompt"], response_ids=torch.tensor(r["response"])) for r in rows]  # type: ignore[arg-type]
    trainer_lp, mask = engine.compute_logprobs(plain)  # [B, T] under the pre-update weights
    gen = torch.Generator().manual_seed(1)
    noise = 0.3 * torch.randn(trainer_lp.shape, generator=gen)
    for i, r in enumerate(rows):
        n = len(r["response"])  # type: ignore[arg-type]
        r["logprobs"] = (trainer_lp[i, :n] + noise[i, :n]).tolist()  # behaviour = trainer + known offset

    # Reference, pooled over every current-version token: w = log π − log μ = −noise.
    current = torch.zeros_like(mask)
    for i, r in enumerate(rows):
        versions = torch.tensor(r["token_versions"])  # type: ignore[arg-type]
        current[i, : len(versions)] = (versions == VERSION).float()
    keep = (mask * current).bool()
    w = -noise.double()[keep]
    expected = float((torch.exp(w) - 1 - w).mean())

    samples = build_train_samples(cfg, rows, version=VERSION)  # type: ignore[arg-type]
    metrics = engine.step(samples, make_loss_fn(cfg))
    pop_rollout_mismatch(metrics)
    assert metrics["rollout_mismatch_kl"] == pytest.approx(expected, rel=1e-4)
    assert not any(k.endswith("_per_unit") for k in metrics)


def test_no_current_version_tokens_report_nothing() -> None:
    lp = torch.zeros(2, 3)
    sums = mismatch_sums(lp, lp - 0.1, torch.ones(2, 3), torch.zeros(2, 3), per_token=True)
    metrics = {"loss": 1.0, **sums}
    pop_rollout_mismatch(metrics)
    assert metrics == {"loss": 1.0}


def test_k3_by_hand() -> None:
    # One current token with w = log π − log μ = 0.5, one with w = −0.2, one current token masked out, one stale.
    trainer = torch.tensor([[0.5, -0.2, 9.0, 1.0]])
    behaviour = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    current = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    metrics = mismatch_sums(trainer, behaviour, mask, current, per_token=True)
    pop_rollout_mismatch(metrics)
    k3 = lambda w: torch.exp(torch.tensor(w)) - 1 - w  # noqa: E731
    assert metrics["rollout_mismatch_kl"] == pytest.approx(float((k3(0.5) + k3(-0.2)) / 2), rel=1e-6)


def test_tiny_differences_are_not_rounded_away() -> None:
    # |w| = 1e-6: k3 ≈ w²/2 = 5e-13, below float32's resolution of exp(w) − 1 − w.
    trainer = torch.tensor([[-1.0, -2.0]])
    behaviour = trainer - 1e-6
    metrics = mismatch_sums(trainer, behaviour, torch.ones(1, 2), torch.ones(1, 2), per_token=True)
    pop_rollout_mismatch(metrics)
    w = (trainer.double() - behaviour.double())[0]
    assert metrics["rollout_mismatch_kl"] == pytest.approx(float((w**2 / 2).mean()), rel=1e-3)
    assert metrics["rollout_mismatch_kl"] > 0
