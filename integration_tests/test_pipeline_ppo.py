"""PPO with a critic: a Critic service (its own process) writes values under the critic weights the Trainer
trains and publishes; GAE on-policy, V-trace targets for stale data."""

from __future__ import annotations

import math

import pytest
import torch

from relax_services.config import load_run_config
from relax_services.control.checkpoint import CheckpointManager
from relax_services.control.warmup import format_warmup
from relax_services.data.run_data import prepare_data, warmup_items
from relax_services.models.policy import build_policy
from relax_services.reporting.metrics import read_metrics

STEPS = 3


@pytest.mark.integration
def test_ppo_tau0_pipeline_equals_sequential_ppo(small_config, run_pipeline, sequential_weights, tmp_path) -> None:
    """At τ = 0 the pipeline (Rollout, Reward, Critic, Trainer processes) ends where the sequential PPO loop
    does: policy and critic weights both."""
    overrides = [
        "algorithm.preset=ppo",
        "algorithm.group_size=4",
        "algorithm.kl_coef=0.0",
        "staleness.tau=0",
        f"trainer.total_steps={STEPS}",
        "data.adaptive_weights=false",
        "data.tasks=[image, text]",
    ]
    # Start both from a format-warmed checkpoint, so that answers are valid options and some are right: with
    # all rewards zero neither the policy nor the critic would move and the comparison would prove nothing. 20
    # steps left the format half-learned (2 of 48 samples right; none under another prompt order); 60 give rewards
    # near chance (0.31, 0.44, 0.06 by step).
    warm = small_config(*overrides, "trainer.warmup_format_steps=60")
    data = prepare_data(warm, tmp_path / "warm")
    format_warmup(warm, warmup_items(warm), data.to_prompt, str(tmp_path / "warm_model"))
    cfg = small_config(*overrides, f"model.source={tmp_path / 'warm_model'}")
    assert cfg.algorithm.uses_critic and cfg.algorithm.advantage_estimator == "gae"
    result = run_pipeline(cfg)
    assert result.steps == STEPS
    assert result.staleness_hist == {0: STEPS * cfg.samples_per_step}
    assert "critic" in result.service_pids
    latest = CheckpointManager(result.run_dir / "checkpoints").latest()
    assert latest is not None
    state = CheckpointManager.load_engine(latest)
    got = {**state["model"], **{f"critic.{k}": v for k, v in state["critic"]["model"].items()}}

    expected = sequential_weights(cfg, tmp_path / "sequential", STEPS)
    assert expected["critic.value_head.weight"].abs().sum() > 0, "the reference critic did not train"
    start = build_policy(cfg.model).state_dict()
    assert any(not torch.equal(start[k], expected[k]) for k in start), "the reference policy did not train"
    for name, want in expected.items():
        # Values are computed in whatever batches the rows reach the Critic in; padding to a different length
        # changes float rounding, so equality is to float32 precision rather than bitwise.
        torch.testing.assert_close(got[name], want, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.integration
@pytest.mark.slow  # ~16 s; out of the default suite for its budget (V-trace: test_advantages, test_seam_algorithm)
def test_ppo_vtrace_with_stale_data_trains_policy_and_critic(small_config, run_pipeline) -> None:
    cfg = small_config(
        "algorithm.preset=ppo",
        "algorithm.advantage_estimator=vtrace",
        "algorithm.group_size=4",
        "algorithm.kl_coef=0.0",
        "staleness.tau=1",
        "trainer.total_steps=6",
        "data.tasks=[text, audio]",
    )
    result = run_pipeline(cfg)
    assert result.steps == 6
    assert max(result.staleness_hist) <= 1
    assert result.ledger["lost"] == 0 and result.ledger["duplicated"] == 0
    train = list(read_metrics(result.run_dir / "metrics.jsonl", "train"))
    assert len(train) == 6
    for row in train:
        assert math.isfinite(row["critic_vf_loss"]) and math.isfinite(row["loss"])
    critic_rows = list(read_metrics(result.run_dir / "metrics.jsonl", "critic"))
    assert sum(r["scored"] for r in critic_rows) >= 6 * cfg.samples_per_step
    assert max(r["version"] for r in critic_rows) >= 1  # the Critic pulled weights the Trainer published


def test_gae_with_stale_data_is_refused_naming_the_fields() -> None:
    from relax_core import ConfigError

    with pytest.raises(ConfigError, match=r"advantage_estimator='gae'.*staleness\.tau=2.*vtrace"):
        load_run_config(None, ["algorithm.preset=ppo", "staleness.tau=2"])
    assert load_run_config(None, ["algorithm.preset=ppo", "algorithm.advantage_estimator=vtrace"]).algorithm.uses_critic
