"""``trainer.world_size`` in the run config: which engine it selects, the equal-share rule, and the errors that
name the fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_core import ConfigError
from relax_services.config import load_run_config
from relax_services.config.trainer_group import rank_split, single_process
from relax_services.engines.registry import TRAIN_ENGINES, check_engines, resolve


def test_world_size_one_keeps_the_single_process_engine() -> None:
    cfg = load_run_config(None, [])
    assert cfg.trainer.world_size == 1 and cfg.trainer.engine == "torch"


def test_world_size_two_alone_selects_the_fsdp_group_engine() -> None:
    cfg = load_run_config(None, ["trainer.world_size=2", "trainer.groups_per_step=4", "algorithm.group_size=4"])
    assert cfg.trainer.engine == "fsdp"
    assert "fsdp" in TRAIN_ENGINES
    check_engines(cfg)  # the id resolves to an importable factory
    assert resolve(TRAIN_ENGINES, "fsdp", field="trainer.engine").__name__ == "build_trainer_group"
    # 4 groups × 4 samples on 2 ranks: 8 samples, two whole groups, each.
    assert rank_split(cfg) == (16, 8)


def test_a_one_rank_group_is_allowed() -> None:
    cfg = load_run_config(None, ["trainer.engine=fsdp"])
    assert cfg.trainer.world_size == 1 and cfg.trainer.engine == "fsdp"


def test_single_process_engine_with_two_ranks_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"trainer.world_size=2 needs a multi-rank trainer.engine.*'torch'"):
        load_run_config(None, ["trainer.world_size=2", "trainer.engine=torch"])


@pytest.mark.parametrize(
    ("overrides", "per_minibatch"),
    [
        # 4 groups × 4 samples = 16 samples on 3 ranks
        (["trainer.world_size=3", "trainer.groups_per_step=4", "algorithm.group_size=4"], 16),
        # 4 groups / 4 minibatches × 3 samples = 3 samples per minibatch on 2 ranks
        (
            [
                "trainer.world_size=2",
                "trainer.groups_per_step=4",
                "trainer.micro_batch_groups=1",
                "trainer.minibatches=4",
                "algorithm.group_size=3",
            ],
            3,
        ),
    ],
)
def test_unequal_shares_are_refused(overrides: list[str], per_minibatch: int) -> None:
    with pytest.raises(ConfigError, match=rf"must divide the samples of each minibatch.* = {per_minibatch} "):
        load_run_config(None, overrides)


def test_groups_split_between_ranks_are_allowed() -> None:
    # 3 groups of 2 on 2 ranks: 3 samples each, the middle group split (an equal share is what the engine needs).
    cfg = load_run_config(None, ["trainer.world_size=2", "trainer.groups_per_step=3", "algorithm.group_size=2"])
    assert rank_split(cfg) == (6, 3)


def test_filtered_groups_need_a_group_size_the_ranks_divide() -> None:
    base = ["trainer.world_size=2", "trainer.groups_per_step=4", "algorithm.group_size=3"]
    assert rank_split(load_run_config(None, base)) == (12, 6)
    with pytest.raises(ConfigError, match=r"must divide algorithm.group_size=3 with algorithm.filter_groups"):
        load_run_config(None, [*base, "algorithm.filter_groups=true"])


def test_a_group_engine_cannot_run_colocated() -> None:
    with pytest.raises(ConfigError, match=r"run.mode='colocated' runs without Ray"):
        load_run_config(None, ["trainer.world_size=2", "run.mode=colocated"])


def test_kill_rank_faults_need_a_trainer_group() -> None:
    with pytest.raises(ConfigError, match=r"kind 'kill_rank'.*trainer.engine='torch'"):
        load_run_config(None, ["faults=[{service: trainer, kind: kill_rank}]"])
    with pytest.raises(ConfigError, match=r"kind 'kill_rank'.*got service 'rollout'"):
        load_run_config(None, ["trainer.world_size=2", "faults=[{service: rollout, kind: kill_rank}]"])
    cfg = load_run_config(None, ["trainer.world_size=2", "faults=[{service: trainer, kind: kill_rank, at_step: 3}]"])
    assert cfg.faults[0].kind == "kill_rank"


def test_scoring_services_get_a_single_process_copy() -> None:
    cfg = load_run_config(None, ["trainer.world_size=2"])
    one = single_process(cfg)
    assert (one.trainer.engine, one.trainer.world_size) == ("torch", 1)
    assert (cfg.trainer.engine, cfg.trainer.world_size) == ("fsdp", 2)  # the run's own config is unchanged
    plain = load_run_config(None, [])
    assert single_process(plain) is plain


def test_resume_may_change_the_world_size_of_a_group_but_not_its_engine(tmp_path: Path) -> None:
    from relax_core import dump_config
    from relax_services.config.resume import resume_config

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    named = [f"run.output_dir={tmp_path}", "run.name=r"]
    saved = load_run_config(None, [*named, "trainer.world_size=2"])
    (run_dir / "config.yaml").write_text(dump_config(saved))
    cfg, changed = resume_config(run_dir, None, [*named, "trainer.world_size=1"])
    assert (cfg.trainer.engine, cfg.trainer.world_size) == ("fsdp", 1)  # the saved engine id, not re-derived
    assert changed == {"trainer.world_size": (2, 1)}
    # The single-process engine keeps its optimizer by index, the group's checkpoint by parameter name.
    with pytest.raises(ConfigError, match=r"trainer.engine: cannot change on --resume"):
        resume_config(run_dir, None, [*named, "trainer.world_size=1", "trainer.engine=torch"])


def test_the_group_layout_is_relax_parallels_data_parallel_plan() -> None:
    from relax_parallel import ParallelConfig, ParallelPlan
    from relax_services.engines.fsdp.group import TrainerGroupConfig

    group = TrainerGroupConfig(world_size=2)
    assert group.layout == ParallelConfig(dp=2)
    # The mesh every rank builds: ("pp", "dp", "cp", "tp") = (1, 2, 1, 1); the engine shards over "dp".
    assert ParallelPlan.from_config(group.layout).mesh_shape() == (1, 2, 1, 1)
    # Tensor and sequence (cp) parallelism are realised (dp × cp × tp ranks); pipeline and expert parallelism are not.
    assert TrainerGroupConfig(world_size=2, parallel=ParallelConfig(tp=2)).layout.tp == 2
    assert TrainerGroupConfig(world_size=2, parallel=ParallelConfig(cp=2)).layout.cp == 2
    with pytest.raises(
        ValueError, match=r"must be data-, sequence- \(cp\) and tensor-parallel over the world_size=2 .*pp=2"
    ):
        TrainerGroupConfig(world_size=2, parallel=ParallelConfig(pp=2))
    with pytest.raises(ValueError, match=r"world_size=2 ranks .*dp=4"):
        TrainerGroupConfig(world_size=2, parallel=ParallelConfig(dp=4))


def test_relax_plan_prints_the_trainer_plan_of_a_run_config(capsys: pytest.CaptureFixture[str]) -> None:
    from relax_services.cli import main

    assert main(["plan", "trainer.world_size=2", "trainer.groups_per_step=4"]) == 0
    # 4 groups × 8 samples = 32 per minibatch, 16 per rank; micro_batch_groups defaults to 4 (32 samples), so
    # a rank's micro-batch is its whole share. Mesh (pp, dp, cp, tp) = (1, 2, 1, 1): one dp group of both ranks.
    expected = """\
[trainer] engine fsdp, 2 rank(s) over gloo: tp=1 pp=1 cp=1 ep=1 dp=2 mb=16 recompute=none
  mesh       (pp, dp, cp, tp) = (1, 2, 1, 1)
  pp groups  [[0], [1]]; rank 0 in [0]
  dp groups  [[0, 1]]; rank 0 in [0, 1]
  cp groups  [[0], [1]]; rank 0 in [0]
  tp groups  [[0], [1]]; rank 0 in [0]
  - FSDP2 shards parameters, gradients and optimizer state over dp=2; every rank trains on an equal share of \
each minibatch, in micro-batches of at most 16 samples
"""
    assert capsys.readouterr().out == expected
    assert main(["plan"]) == 0
    assert capsys.readouterr().out == "[trainer] engine torch: one process, no process group (trainer.world_size=1)\n"


def test_relax_plan_names_a_bad_run_config_field(capsys: pytest.CaptureFixture[str]) -> None:
    from relax_services.cli import main

    assert main(["plan", "trainer.world_size=3"]) == 2
    assert "trainer.world_size=3 must divide the samples of each minibatch" in capsys.readouterr().err


def test_relax_plan_with_options_is_the_cluster_planner(capsys: pytest.CaptureFixture[str]) -> None:
    from relax_services.cli import main

    assert main(["plan", "--model", "qwen2-7b", "--gpus", "8", "--no-split"]) == 0
    assert "== training on all 8 GPUs" in capsys.readouterr().out


def test_tensor_parallel_in_the_run_config_is_the_plans_tp(capsys: pytest.CaptureFixture[str]) -> None:
    from relax_services.cli import main
    from relax_services.engines.trainer_plan import trainer_layout

    overrides = ["trainer.world_size=4", "trainer.tensor_parallel=2", "trainer.groups_per_step=4"]
    cfg = load_run_config(None, overrides)
    layout = trainer_layout(cfg)
    # 4 ranks = dp 2 × tp 2; each dp rank trains on half of the 32 samples of a minibatch.
    assert (layout.dp, layout.tp, layout.micro_batch) == (2, 2, 16)
    assert rank_split(cfg) == (32, 16)
    assert main(["plan", *overrides]) == 0
    out = capsys.readouterr().out
    # tp varies fastest (megatron's order): tp groups {0, 1} and {2, 3}, dp groups {0, 2} and {1, 3}.
    assert "  mesh       (pp, dp, cp, tp) = (1, 2, 1, 2)\n" in out
    assert "  dp groups  [[0, 2], [1, 3]]; rank 0 in [0, 2]\n" in out
    assert "  tp groups  [[0, 1], [2, 3]]; rank 0 in [0, 1]\n" in out
    assert "split over tp=2 ranks" in out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.world_size=2", "trainer.tensor_parallel=4"],
            r"trainer.tensor_parallel=4 must divide trainer.world_size=2",
        ),
        (["trainer.tensor_parallel=2"], r"trainer.tensor_parallel=2 needs a multi-rank trainer.engine"),
        (
            ["trainer.world_size=6", "trainer.tensor_parallel=2", "trainer.groups_per_step=4"],
            r"trainer.world_size / tensor_parallel = 3 must divide the samples of each minibatch",
        ),
    ],
)
def test_bad_tensor_parallel_settings_name_the_fields(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, overrides)


def test_tensor_parallel_must_divide_the_decoders_heads() -> None:
    from relax_services.engines.fsdp.tensor_parallel import _check_divisible
    from relax_services.engines.fsdp.train import decoder_blocks
    from relax_services.models import build_tiny_omni

    block = decoder_blocks(build_tiny_omni(0))[0]  # 4 attention heads, 2 key/value heads, MLP 128
    _check_divisible(0, block, 2)
    with pytest.raises(ValueError, match=r"tp=4 must divide the key/value heads of decoder block 0, got 2"):
        _check_divisible(0, block, 4)
    with pytest.raises(ValueError, match=r"tp=3 must divide the attention heads of decoder block 0, got 4"):
        _check_divisible(0, block, 3)


# -- trainer.sequence_parallel ----------------------------------------------------------------------------------


def test_sequence_parallel_is_the_plans_cp_dimension_and_shrinks_data_parallelism() -> None:
    from relax_services.config.trainer_group import data_parallel
    from relax_services.engines.trainer_plan import trainer_layout, trainer_plan_text

    cfg = load_run_config(
        None,
        ["trainer.world_size=4", "trainer.sequence_parallel=2", "trainer.groups_per_step=4", "algorithm.group_size=4"],
    )
    assert data_parallel(cfg) == 2  # 4 ranks / sp 2
    assert rank_split(cfg) == (16, 8)  # each sp group trains on half of a minibatch
    layout = trainer_layout(cfg)
    assert (layout.dp, layout.cp, layout.tp) == (2, 2, 1)
    text = trainer_plan_text(cfg)
    # rank r at cp = r mod 2, dp = r // 2 (ParallelPlan.device_mesh): sp groups {0, 1} and {2, 3}
    assert "mesh       (pp, dp, cp, tp) = (1, 2, 2, 1)" in text
    assert "cp groups  [[0, 1], [2, 3]]; rank 0 in [0, 1]" in text
    assert "sequence parallelism (Ulysses) over the cp dimension, sp=2" in text
    assert single_process(cfg).trainer.sequence_parallel == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.sequence_parallel=2"], r"trainer.sequence_parallel=2 needs a multi-rank trainer.engine"),
        (
            ["trainer.world_size=4", "trainer.tensor_parallel=2", "trainer.sequence_parallel=4"],
            r"trainer.sequence_parallel=4 must divide trainer.world_size / tensor_parallel = 4 / 2 = 2",
        ),
        (
            ["trainer.world_size=2", "trainer.sequence_parallel=2", "trainer.packing=true"],
            r"trainer.sequence_parallel=2 splits padded rows; trainer.packing=true",
        ),
    ],
)
def test_sequence_parallel_combinations_it_cannot_run_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, overrides)


def test_sequence_parallel_must_divide_the_models_heads() -> None:
    from relax_services.config.trainer_group import check_sequence_parallel_heads

    cfg = load_run_config(None, ["trainer.world_size=8", "trainer.sequence_parallel=8", "trainer.groups_per_step=8"])
    # the tiny omni thinker's layout: 4 heads, 2 key/value heads, under thinker_config.text_config
    omni = {"thinker_config": {"text_config": {"num_attention_heads": 4, "num_key_value_heads": 2}}}
    with pytest.raises(ValueError, match=r"sequence_parallel=8 × trainer.tensor_parallel=1 must divide the model's "):
        check_sequence_parallel_heads(cfg, omni)
    with pytest.raises(ValueError, match=r"attention heads \(12\)"):
        check_sequence_parallel_heads(cfg, {"num_attention_heads": 12, "num_key_value_heads": 4})
    check_sequence_parallel_heads(cfg, {"num_attention_heads": 16, "num_key_value_heads": 2})  # kv heads expanded
    four = load_run_config(None, ["trainer.world_size=4", "trainer.sequence_parallel=4", "trainer.groups_per_step=4"])
    check_sequence_parallel_heads(four, omni)  # 4 heads, one per rank; the 2 key/value heads go expanded
    tp = load_run_config(None, ["trainer.world_size=4", "trainer.sequence_parallel=2", "trainer.tensor_parallel=2"])
    check_sequence_parallel_heads(tp, omni)  # 4 / (2 × 2) = 1 head per rank
