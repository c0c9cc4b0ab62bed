"""Derived run settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_core import ConfigError
from relax_services.config import load_run_config


@pytest.mark.parametrize(
    ("groups_per_step", "groups_per_call", "expected"),
    [(32, 16, 16), (4, 16, 4), (12, 8, 6), (6, 4, 3), (7, 4, 1), (32, 1, 1)],
)
def test_rollout_call_groups_divide_an_update(groups_per_step: int, groups_per_call: int, expected: int) -> None:
    cfg = load_run_config(
        None,
        [
            f"trainer.groups_per_step={groups_per_step}",
            f"trainer.micro_batch_groups={groups_per_step}",
            f"rollout.groups_per_call={groups_per_call}",
        ],
    )
    assert cfg.rollout_call_groups == expected


def test_the_lr_schedule_spans_the_run_unless_set() -> None:
    """One source of truth for the run length: 200 updates decay the cosine schedule to its floor at update 200."""
    from relax_services.engines.torch import train_config

    decaying = ["optimizer.schedule=cosine", "optimizer.min_lr_ratio=0.1"]  # the default run's LR is constant
    cfg = load_run_config(None, ["trainer.total_steps=200", *decaying])
    assert cfg.optimizer.total_steps == 200
    engine_cfg = train_config(cfg)
    assert engine_cfg.lr_factor(200) == pytest.approx(cfg.optimizer.min_lr_ratio)  # 0.1, not 0.915
    assert load_run_config(None, ["trainer.total_steps=200", "optimizer.total_steps=500"]).optimizer.total_steps == 500
    assert load_run_config().optimizer.total_steps == load_run_config().trainer.total_steps == 1000


@pytest.mark.parametrize(("groups", "micro"), [(4, 4), (32, 32), (48, 24), (64, 32), (7, 7)])
def test_groups_per_step_alone_is_a_valid_run(groups: int, micro: int) -> None:
    cfg = load_run_config(None, [f"trainer.groups_per_step={groups}"])
    assert cfg.trainer.micro_batch_groups == micro
    assert (
        load_run_config(
            None, [f"trainer.groups_per_step={groups}", "trainer.micro_batch_groups=1"]
        ).trainer.micro_batch_groups
        == 1
    )


def test_an_update_larger_than_the_queue_is_a_config_error_naming_both_fields() -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(None, ["trainer.groups_per_step=1024", "trainer.total_steps=3"])
    text = str(info.value)
    assert "trainer.groups_per_step=1024" in text and "queue.max_rows=4096" in text and "8192" in text
    assert "{" not in text  # the message, not the whole input
    load_run_config(None, ["trainer.groups_per_step=512"])  # 4096 samples: exactly fits


def test_actor_faults_are_kills_and_only_actors_die_during_a_restart() -> None:
    cfg = load_run_config(None, ["faults=[{service: sample_queue, kind: kill, at_step: 3, during_restart: true}]"])
    assert cfg.faults[0].service == "sample_queue" and cfg.faults[0].during_restart
    with pytest.raises(ConfigError, match=r"sample_queue: an actor without a work loop can only be killed"):
        load_run_config(None, ["faults=[{service: sample_queue, kind: hang}]"])
    with pytest.raises(ConfigError, match=r"fault on rollout: during_restart applies to prompt_queue, sample_queue"):
        load_run_config(None, ["faults=[{service: rollout, kind: kill, during_restart: true}]"])
    with pytest.raises(ConfigError, match="service"):
        load_run_config(None, ["faults=[{service: no_such_actor}]"])


def test_a_fault_on_a_role_the_run_does_not_have_is_a_config_error() -> None:
    # The default run (GRPO, no KL) has neither a critic nor a Reference: the fault could never land.
    for service in ("critic", "critic_weights"):
        with pytest.raises(ConfigError, match=rf"faults\[0\].service='{service}': this run has none .*grpo"):
            load_run_config(None, ["algorithm.kl_coef=0", f"faults=[{{service: {service}, kind: kill}}]"])
    with pytest.raises(ConfigError, match=r"faults\[1\].service='reference': this run has none \(algorithm.kl_coef=0"):
        load_run_config(
            None, ["algorithm.kl_coef=0", "faults=[{service: reward, kind: kill}, {service: reference, kind: kill}]"]
        )
    ppo = load_run_config(
        None, ["algorithm.preset=ppo", "staleness.tau=0", "faults=[{service: critic_weights, kind: kill}]"]
    )
    assert ppo.algorithm.uses_critic and ppo.faults[0].service == "critic_weights"


@pytest.mark.parametrize(
    ("overrides", "full_kl"),
    [
        ([], True),  # the default run's KL is the full-vocabulary one
        (["algorithm.kl_estimator=k3"], False),
        (["algorithm.kl_coef=0"], False),  # no KL term: nothing reads the distribution
    ],
)
def test_only_the_trainers_engine_of_a_full_kl_run_holds_a_reference(overrides: list[str], full_kl: bool) -> None:
    from relax_services.engines.torch import train_config

    cfg = load_run_config(None, overrides)
    assert cfg.algorithm.uses_full_kl is full_kl
    assert train_config(cfg).full_kl is full_kl
    assert train_config(cfg).reference_dtype == "float32"  # the Reference service's dtype on the CPU
    assert not train_config(cfg, "reference").full_kl  # the Reference service's own engine scores log-probs only


def test_a_checkpoint_of_ones_own_defaults_to_the_sampled_token_kl(tmp_path: Path) -> None:
    """The default run keeps its exact KL over the vocabulary; a user's checkpoint gets k3, whose queue rows carry
    per-token log-probs, not ``[L, V]`` distributions; an explicit choice or a preset of one's own is kept."""
    assert load_run_config(None, []).algorithm.kl_estimator == "full"
    own = load_run_config(None, [f"model.source={tmp_path}"])
    assert own.algorithm.kl_estimator == "k3" and own.algorithm.kl_coef == 0.1 and not own.algorithm.uses_full_kl
    kept = load_run_config(None, [f"model.source={tmp_path}", "algorithm.kl_estimator=full"])
    assert kept.algorithm.kl_estimator == "full"
    from_file = tmp_path / "run.yaml"
    from_file.write_text(f"model:\n  source: {tmp_path}\nalgorithm:\n  group_size: 4\n", encoding="utf-8")
    assert load_run_config(from_file).algorithm.kl_estimator == "k3"


def test_dr_grpo_normaliser_is_the_generation_budget() -> None:
    """Dr.GRPO divides token sums by ``rollout.max_new_tokens`` (one source of truth), not the padded width."""
    cfg = load_run_config({"algorithm": {"preset": "dr_grpo"}, "rollout": {"max_new_tokens": 12}})
    assert cfg.algorithm.loss_agg_mode == "seq-mean-token-sum-norm" and cfg.algorithm.loss_norm_constant == 12
    assert load_run_config({"algorithm": {"preset": "dr_grpo"}}).algorithm.loss_norm_constant == 4
    given = load_run_config({"algorithm": {"preset": "dr_grpo", "loss_norm_constant": 7}}, ["rollout.max_new_tokens=9"])
    assert given.algorithm.loss_norm_constant == 7
    assert (
        load_run_config(overrides=["algorithm.loss_agg_mode=seq-mean-token-sum-norm"]).algorithm.loss_norm_constant == 4
    )
    assert load_run_config().algorithm.loss_norm_constant is None  # other modes have no constant


def test_remax_takes_a_single_turn_greedy_baseline_and_is_refused_with_episodes(tmp_path) -> None:
    load_run_config(overrides=["algorithm.advantage_estimator=remax"])
    env = tmp_path / "env.py"
    env.write_text("class E:\n    def reset(self, row):\n        return []\n")
    with pytest.raises(ConfigError, match="greedy single-turn response"):
        load_run_config(overrides=["algorithm.advantage_estimator=remax", f"rollout.env={env}:E"])
