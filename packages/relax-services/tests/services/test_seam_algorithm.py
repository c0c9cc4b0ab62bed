"""A new advantage estimator is one entry in relax-core's algorithm table plus its pure function.

The toy estimator below lives entirely in this file: it is registered into ``relax_core.ALGORITHMS`` (the
documented extension point) and from then on config validation, presets, ``compute_advantages``, the
trainer's fields and the pipeline choice all know it, with no other file touched.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from relax_core import (
    ALGORITHMS,
    AlgorithmConfig,
    AlgorithmSpec,
    ConfigError,
    EstimatorInputs,
    broadcast_to_tokens,
    compute_advantages,
)
from relax_services.config import load_run_config
from relax_services.control.pipeline import build_pipeline, pipeline_family
from relax_services.services.trainer import build_train_samples, trainer_fields


def fixed_baseline_advantages(scores: Tensor, baseline: float) -> Tensor:
    """The toy estimator's pure function: ``A_i = r_i − b`` for a constant baseline ``b`` (``[B]``)."""
    return scores - baseline


def _toy(cfg: AlgorithmConfig, inputs: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    return broadcast_to_tokens(fixed_baseline_advantages(inputs.scores, 0.5), inputs.mask), None


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = AlgorithmSpec(
        advantage=_toy,
        summary="constant baseline 0.5",
        needs_groups=True,
        presets={"toy_preset": {"group_size": 3, "kl_coef": 0.0, "loss_agg_mode": "token-mean"}},
    )
    monkeypatch.setitem(ALGORITHMS, "fixed_baseline", spec)


def test_unregistered_estimator_is_rejected_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(None, ["algorithm.advantage_estimator=fixed_baseline"])
    issue = info.value.issues[0]
    assert issue.path == "algorithm.advantage_estimator" and issue.value == "fixed_baseline"
    assert issue.allowed is not None and "'vtrace'" in issue.allowed and "fixed_baseline" not in issue.allowed


@pytest.mark.usefixtures("toy")
def test_a_registered_toy_estimator_is_validated_preset_and_dispatched() -> None:
    # Validation reads the entry's needs: a group estimator refuses groups of one.
    with pytest.raises(ConfigError, match=r">= 2 for advantage_estimator=fixed_baseline"):
        load_run_config(None, ["algorithm.advantage_estimator=fixed_baseline", "algorithm.group_size=1"])
    # Its preset is found by name and brings the estimator with it.
    cfg = load_run_config(None, ["algorithm.preset=toy_preset"])
    assert (cfg.algorithm.advantage_estimator, cfg.algorithm.group_size) == ("fixed_baseline", 3)
    assert not cfg.algorithm.uses_critic and not cfg.algorithm.uses_reference

    # compute_advantages dispatches to it: scores [1, 0, 0.25] minus 0.5 on each valid token.
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    out = compute_advantages(cfg.algorithm, torch.tensor([1.0, 0.0, 0.25]), mask, group_ids=["a", "a", "a"])
    expected = torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0], [-0.25, -0.25, -0.25]])
    assert torch.allclose(out.advantages, expected)
    with pytest.raises(ValueError, match=r"fixed_baseline.*needs group_ids"):
        compute_advantages(cfg.algorithm, torch.tensor([1.0, 0.0, 0.25]), mask)

    # The services read the same entry: no critic fields, the critic-free pipeline, advantages on the rows.
    assert "values" not in trainer_fields(cfg) and "ref_logprobs" not in trainer_fields(cfg)
    assert pipeline_family("fixed_baseline") == "grpo"
    rows = [
        {"prompt": "p", "meta": {"prompt_key": "a"}, "response": [1, 2], "logprobs": [-1.0, -1.0], "reward": 1.0},
        {"prompt": "p", "meta": {"prompt_key": "a"}, "response": [3], "logprobs": [-1.0], "reward": 0.0},
    ]
    samples = build_train_samples(cfg, rows)
    assert [s.fields["advantages"].tolist() for s in samples] == [[0.5, 0.5], [-0.5]]


def test_critic_and_on_policy_needs_reach_config_checks_and_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = AlgorithmSpec(advantage=_toy, needs_critic=True, on_policy_only=True)
    monkeypatch.setitem(ALGORITHMS, "toy_critic", spec)
    with pytest.raises(ConfigError, match=r"advantage_estimator='toy_critic' assumes on-policy.*tau=2.*vtrace"):
        load_run_config(None, ["algorithm.advantage_estimator=toy_critic", "staleness.tau=2"])
    cfg = load_run_config(None, ["algorithm.advantage_estimator=toy_critic", "staleness.tau=0"])
    assert cfg.algorithm.uses_critic and "values" in trainer_fields(cfg)
    assert pipeline_family("toy_critic") == "ppo"

    built: list[str] = []
    fake = {family: (lambda *args, family=family: built.append(family)) for family in ("grpo", "ppo")}
    monkeypatch.setattr("relax_services.control.pipeline.PIPELINE_BUILDERS", fake)
    build_pipeline(cfg, [])  # the builder is chosen from the entry: the critic pipeline, without starting it
    assert built == ["ppo"]
