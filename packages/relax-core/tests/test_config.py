"""Config loading, overrides, validation errors, YAML round trip and presets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

import relax_core as rc


class RunConfig(rc.ConfigModel):
    """A run config composed the way relax-services composes its own."""

    algorithm: rc.AlgorithmConfig = pydantic.Field(default_factory=rc.AlgorithmConfig)
    """The algorithm."""

    optimizer: rc.OptimizerConfig = pydantic.Field(default_factory=rc.OptimizerConfig)
    """The optimizer."""

    staleness: rc.StalenessConfig = pydantic.Field(default_factory=rc.StalenessConfig)
    """The staleness bound."""

    reward: rc.RewardRunnerConfig = pydantic.Field(default_factory=rc.RewardRunnerConfig)
    """The reward."""


COMPONENTS = [
    rc.AlgorithmConfig,
    rc.OptimizerConfig,
    rc.StalenessConfig,
    rc.RewardRunnerConfig,
    rc.RewardSpec,
    rc.RemoteRewardConfig,
]


def _error(source: Any, overrides: list[str] | None = None) -> rc.ConfigError:
    with pytest.raises(rc.ConfigError) as info:
        rc.load_config(RunConfig, source, overrides or [])
    return info.value


@pytest.mark.parametrize("cls", COMPONENTS)
def test_every_field_is_documented(cls: type[rc.ConfigModel]) -> None:
    for name, field in cls.model_fields.items():
        assert field.description and len(field.description) > 10, f"{cls.__name__}.{name} has no docstring"


def test_defaults_load_without_a_source() -> None:
    cfg = rc.load_config(RunConfig)
    assert cfg == RunConfig()
    assert cfg.algorithm.advantage_estimator == "grpo" and cfg.staleness.tau == 0


def test_yaml_file_plus_dotted_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  clip_eps_high: 0.25\n  policy_loss: gspo\noptimizer:\n  lr: 3.0e-4\n")
    cfg = rc.load_config(
        RunConfig,
        path,
        [
            "algorithm.clip_eps_high=0.28",
            "staleness.tau=null",
            "optimizer.betas=[0.9, 0.95]",
            "reward.default.kwargs.k=1",
        ],
    )
    assert cfg.algorithm.clip_eps_high == 0.28
    assert cfg.algorithm.policy_loss == "gspo"
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.staleness.tau is None
    assert cfg.reward.default.kwargs == {"k": 1}


def test_scientific_notation_override_is_a_float() -> None:
    assert rc.load_config(RunConfig, {}, ["optimizer.lr=1e-5"]).optimizer.lr == 1e-5


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = rc.load_config(RunConfig, {"algorithm": {"preset": "dapo", "decoupled": True, "tis_cap": 2.0}})
    text = rc.dump_config(cfg)
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    again = rc.load_config(RunConfig, path)
    assert again == cfg
    assert rc.dump_config(again) == text
    assert yaml.safe_load(text)["algorithm"]["clip_eps_high"] == 0.28


@pytest.mark.parametrize(
    ("overrides", "path", "bad", "allowed"),
    [
        (["algorithm.clip_eps_high=-0.1"], "algorithm.clip_eps_high", -0.1, "> 0"),
        (["algorithm.clip_eps_low=1.5"], "algorithm.clip_eps_low", 1.5, "<= 1"),
        (["algorithm.policy_loss=trpo"], "algorithm.policy_loss", "trpo", "'ppo', 'gspo', 'cispo', 'sapo', 'gpg'"),
        (["algorithm.advantage_estimator=a2c"], "algorithm.advantage_estimator", "a2c", "'gae'"),
        (["algorithm.loss_agg_mode=sum"], "algorithm.loss_agg_mode", "sum", "'token-mean'"),
        (["algorithm.kl_estimator=k4"], "algorithm.kl_estimator", "k4", "'k1', 'k2', 'k3', 'abs', 'k1+', 'k3+'"),
        (["algorithm.kl_placement=both"], "algorithm.kl_placement", "both", "'loss' or 'reward'"),
        (["algorithm.gamma=1.5"], "algorithm.gamma", 1.5, "<= 1"),
        (["algorithm.dual_clip_c=0.5"], "algorithm.dual_clip_c", 0.5, "> 1"),
        (["algorithm.group_size=1"], "algorithm.group_size", 1, ">= 2 for advantage_estimator=grpo"),
        (["algorithm.tis_cap=2"], "algorithm.tis_cap", 2, "unless decoupled=true"),
        (["algorithm.mis_level=token"], "algorithm.mis_level", "token", "unless decoupled=true"),
        (["algorithm.decoupled=true", "algorithm.mis_low=1.5"], "algorithm.mis_low", 1.5, "< 1"),
        (["algorithm.mis_high=0.9"], "algorithm.mis_high", 0.9, "> 1"),
        (["algorithm.preset=ppo2"], "algorithm.preset", "ppo2", "'grpo', 'dr_grpo'"),
        (["algorithm.clip_eps_high=abc"], "algorithm.clip_eps_high", "abc", None),
        (["optimizer.lr=0"], "optimizer.lr", 0, "> 0"),
        (["optimizer.betas=[0.9, 1.0]"], "optimizer.betas", [0.9, 1.0], None),
        (["optimizer.schedule=cosine"], "optimizer.total_steps", None, "an int > 0 for schedule=cosine"),
        (["optimizer.schedule=step"], "optimizer.schedule", "step", "'constant', 'linear' or 'cosine'"),
        (["staleness.tau=-1"], "staleness.tau", -1, ">= 0"),
        (["staleness.on_stale=ignore"], "staleness.on_stale", "ignore", "'drop', 'requeue' or 'flag'"),
        (["reward.default.kind=sync"], "reward.default.kind", "sync", "'auto'"),
        (["reward.timeout_s=0"], "reward.timeout_s", 0, "> 0"),
    ],
)
def test_validation_errors_name_field_value_and_allowed(
    overrides: list[str], path: str, bad: Any, allowed: str | None
) -> None:
    err = _error({}, overrides)
    assert err.path == path
    issue = err.issues[0]
    assert issue.value == bad
    assert path in str(err) and repr(bad) in str(err)
    if allowed is not None:
        assert issue.allowed is not None and allowed in issue.allowed
        assert allowed in str(err)


def test_unknown_keys_are_errors_listing_allowed_keys() -> None:
    err = _error({"algorithm": {"clip_eps": 0.2}})
    assert err.path == "algorithm.clip_eps"
    assert err.issues[0].message == "unknown key"
    assert err.issues[0].allowed is not None and "clip_eps_high" in err.issues[0].allowed
    top = _error({}, ["trainer.lr=1"])
    assert top.path == "trainer" and top.issues[0].allowed is not None and "algorithm" in top.issues[0].allowed


def test_every_issue_is_reported() -> None:
    err = _error({}, ["algorithm.gamma=2", "optimizer.lr=-1", "bogus=1"])
    assert {i.path for i in err.issues} == {"algorithm.gamma", "optimizer.lr", "bogus"}


def test_malformed_overrides() -> None:
    for bad in ["algorithm.gamma", "=1", "algorithm..gamma=1"]:
        with pytest.raises(rc.ConfigError, match=r"dotted\.key=value"):
            rc.load_config(RunConfig, {}, [bad])
    err = _error({"algorithm": {"gamma": 1.0}}, ["algorithm.gamma.x=1"])
    assert err.path == "algorithm.gamma" and "not a mapping" in str(err)


def test_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(rc.ConfigError, match="cannot read config file") as info:
        rc.load_config(RunConfig, missing)
    assert str(missing) in str(info.value)
    broken = tmp_path / "broken.yaml"
    broken.write_text("algorithm: [unclosed\n")
    with pytest.raises(rc.ConfigError, match="invalid YAML"):
        rc.load_config(RunConfig, broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(rc.ConfigError, match="top level must be a mapping"):
        rc.load_config(RunConfig, listing)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert rc.load_config(RunConfig, empty) == RunConfig()


def test_assignment_is_validated() -> None:
    cfg = rc.AlgorithmConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.clip_eps_low = 5.0


def test_apply_overrides_does_not_mutate_input() -> None:
    data = {"a": {"b": 1}}
    out = rc.apply_overrides(data, ["a.b=2", "a.c.d=x"])
    assert data == {"a": {"b": 1}} and out == {"a": {"b": 2, "c": {"d": "x"}}}
    assert rc.parse_override("x.y= [1, 2]") == (["x", "y"], [1, 2])


@pytest.mark.parametrize("name", rc.PRESET_NAMES)
def test_presets_load_from_shipped_yaml(name: str) -> None:
    cfg = rc.load_preset(name)
    assert cfg.preset == name
    assert rc.load_config(rc.AlgorithmConfig, yaml.safe_load(rc.dump_config(cfg))) == cfg


def test_preset_contents() -> None:
    dapo = rc.load_preset("dapo")
    assert (dapo.clip_eps_low, dapo.clip_eps_high, dapo.loss_agg_mode, dapo.filter_groups) == (
        0.2,
        0.28,
        "token-mean",
        True,
    )
    dr = rc.load_preset("dr_grpo")
    assert not dr.norm_adv_by_std and dr.loss_agg_mode == "seq-mean-token-sum-norm"
    assert rc.load_preset("gspo").policy_loss == "gspo"
    assert rc.load_preset("rloo").advantage_estimator == "rloo"
    assert rc.load_preset("reinforce_pp").advantage_estimator == "reinforce_pp"
    ppo = rc.load_preset("ppo")
    assert ppo.uses_critic and ppo.advantage_estimator == "gae" and ppo.lam == 0.95
    assert not rc.load_preset("grpo").uses_critic and rc.load_preset("grpo").uses_reference


def test_the_full_kl_is_used_only_with_a_weight() -> None:
    assert rc.AlgorithmConfig(kl_coef=0.1, kl_estimator="full").uses_full_kl
    assert not rc.AlgorithmConfig(kl_coef=0.0, kl_estimator="full").uses_full_kl  # no KL term at all
    assert not rc.AlgorithmConfig(kl_coef=0.1, kl_estimator="k3").uses_full_kl  # a per-token estimate


def test_explicit_keys_override_the_preset() -> None:
    cfg = rc.load_config(RunConfig, {"algorithm": {"preset": "dapo"}}, ["algorithm.clip_eps_high=0.3"])
    assert cfg.algorithm.clip_eps_high == 0.3 and cfg.algorithm.filter_groups
    assert rc.load_preset("grpo", {"kl_coef": 0.0}).kl_coef == 0.0
    with pytest.raises(rc.ConfigError, match="preset"):
        rc.load_preset("nope")


def test_lr_multiplier_schedules() -> None:
    warm = rc.OptimizerConfig(warmup_steps=4)
    assert [rc.lr_multiplier(warm, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    lin = rc.OptimizerConfig(schedule="linear", total_steps=10, min_lr_ratio=0.1)
    assert rc.lr_multiplier(lin, 0) == 1.0
    assert rc.lr_multiplier(lin, 5) == pytest.approx(0.55)
    assert rc.lr_multiplier(lin, 20) == pytest.approx(0.1)
    cos = rc.OptimizerConfig(schedule="cosine", total_steps=12, warmup_steps=2)
    assert rc.lr_multiplier(cos, 7) == pytest.approx(0.5)
    assert rc.lr_multiplier(cos, 12) == pytest.approx(0.0)


def test_staleness_check() -> None:
    strict = rc.StalenessConfig(tau=0)
    assert not strict.is_stale(current_version=3, sample_min_version=3)
    assert strict.is_stale(current_version=4, sample_min_version=3)
    two = rc.StalenessConfig(tau=2)
    assert not two.is_stale(5, 3) and two.is_stale(6, 3)
    assert not rc.StalenessConfig(tau=None).is_stale(10**6, 0)


def test_config_error_from_assignment_error() -> None:
    cfg = rc.AlgorithmConfig()
    with pytest.raises(pydantic.ValidationError) as info:
        cfg.gamma = 2.0
    err = rc.config_error_from(info.value, rc.AlgorithmConfig, prefix="algorithm")
    assert err.path == "algorithm.gamma" and err.issues[0].value == 2.0 and err.issues[0].allowed == ">= 0.0, <= 1.0"
