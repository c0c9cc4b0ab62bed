"""Validity rules, search optimality, explanations naming the binding constraint, infeasibility errors."""

from __future__ import annotations

import re

import pytest

from relax_parallel import (
    ClusterSpec,
    InfeasiblePlanError,
    ModelSpec,
    ParallelConfig,
    WorkloadSpec,
    config_violations,
    enumerate_configs,
    load_model_spec,
    plan_training,
    training_memory,
    training_step_time,
)

QWEN = load_model_spec("qwen2-7b")  # 28 heads, 4 KV heads, 28 layers
TEXT = WorkloadSpec()
C16 = ClusterSpec(num_gpus=16)


@pytest.mark.parametrize(
    ("cfg", "pattern"),
    [
        (ParallelConfig(tp=8, dp=2), "num_kv_heads=4"),  # megatron splits query groups over TP
        (ParallelConfig(tp=16), "exceeds gpus_per_node"),
        (ParallelConfig(pp=8, dp=2), "num_layers=28"),
        (ParallelConfig(ep=2, dp=8), "dense model"),
        (ParallelConfig(dp=8), "world size 16"),
        (ParallelConfig(cp=16), "chunks under 512 tokens"),
    ],
)
def test_invalid_layouts_are_named(cfg: ParallelConfig, pattern: str) -> None:
    problems = config_violations(QWEN, TEXT, C16, cfg, 16)
    assert any(pattern in p for p in problems), problems


def test_valid_layout_has_no_violations() -> None:
    assert config_violations(QWEN, TEXT, C16, ParallelConfig(tp=4, pp=2, dp=2), 16) == []


def test_enumerated_layouts_are_all_valid_and_cover_the_tp_choices() -> None:
    configs = enumerate_configs(QWEN, TEXT, C16, 16)
    assert configs
    for cfg in configs:
        assert cfg.world_size == 16
        assert QWEN.num_heads % cfg.tp == 0 and QWEN.num_kv_heads % cfg.tp == 0
        assert QWEN.num_layers % cfg.pp == 0
    assert {c.tp for c in configs} == {1, 2, 4}
    assert {c.pp for c in configs} == {1, 2, 4}


def test_search_returns_a_fitting_layout_within_tolerance_of_brute_force() -> None:
    plan = plan_training(QWEN, TEXT, C16)
    times = []
    for cfg in enumerate_configs(QWEN, TEXT, C16, 16):
        mem = training_memory(QWEN, TEXT, cfg, "text")
        if mem.total <= C16.usable_bytes:
            times.append(training_step_time(QWEN, TEXT, C16, cfg, mem.gradients).total)
    assert plan.memory.total <= C16.usable_bytes
    assert plan.step_time_s <= min(times) * 1.01 + 1e-9
    assert plan.world_size == 16


def test_compute_bound_plan_names_step_time() -> None:
    plan = plan_training(QWEN, TEXT, ClusterSpec(num_gpus=8))
    assert (plan.tp, plan.pp, plan.cp, plan.dp) == (1, 1, 1, 8)
    assert plan.binding_constraint.startswith("step time")


def test_memory_bound_plan_names_activations_of_long_video(omni: ModelSpec) -> None:
    video = WorkloadSpec(modality_mix={"video": 1.0}, video_frames=256)
    plan = plan_training(omni, video, ClusterSpec(num_gpus=8))
    assert plan.binding_constraint.startswith("memory: activations")
    assert "video" in plan.binding_constraint
    assert plan.cp > 1
    # The explanation shows the simpler layout and by how much it overflows.
    line = next(x for x in plan.explanation if x.startswith(f"cp={plan.cp}:"))
    needed = float(re.search(r"need ([\d.]+) GiB", line).group(1))  # type: ignore[union-attr]
    assert needed > 72.0


def test_allowed_restricts_the_search_to_layouts_an_engine_realises(omni: ModelSpec) -> None:
    """The long-video plan without pipeline stages or recomputation (what the FSDP engine runs): the fastest
    fitting layout among those the predicate accepts, never one it refuses."""
    video = WorkloadSpec(modality_mix={"video": 1.0}, video_frames=256)
    cluster = ClusterSpec(num_gpus=8)

    def fsdp(cfg: ParallelConfig) -> bool:
        return cfg.pp == 1 and cfg.ep == 1 and cfg.recompute == "none"

    plan = plan_training(omni, video, cluster, allowed=fsdp)
    assert fsdp(plan.config) and plan.memory.total <= cluster.usable_bytes
    times = []
    for cfg in enumerate_configs(omni, video, cluster, 8):
        mem = training_memory(omni, video, cfg, "video")
        if fsdp(cfg) and mem.total <= cluster.usable_bytes:
            times.append(training_step_time(omni, video, cluster, cfg, mem.gradients).total)
    assert plan.step_time_s <= min(times) * 1.01 + 1e-9
    with pytest.raises(InfeasiblePlanError, match="no valid layout"):
        plan_training(omni, video, cluster, allowed=lambda cfg: False)


def test_memory_bound_on_model_states_is_named(omni: ModelSpec) -> None:
    moe = load_model_spec("qwen3-omni-30b-a3b")
    plan = plan_training(moe, TEXT, ClusterSpec(num_gpus=8))
    assert plan.binding_constraint.startswith("memory: model states")


def test_infeasible_request_says_what_and_by_how_much(omni: ModelSpec) -> None:
    cluster = ClusterSpec(num_gpus=2, gpu_memory_gib=24)
    with pytest.raises(InfeasiblePlanError) as info:
        plan_training(omni, WorkloadSpec(modality_mix={"text": 0.7, "video": 0.3}), cluster)
    err = info.value
    assert err.required_bytes > err.available_bytes
    assert err.closest is not None
    msg = str(err)
    over = float(re.search(r"([\d.]+) GiB over", msg).group(1))  # type: ignore[union-attr]
    assert over == pytest.approx((err.required_bytes - err.available_bytes) / 2**30, abs=0.06)
    assert "largest term" in msg and "video" in msg


def test_omni_7b_on_16x80_with_30pct_video_gives_valid_explained_plan(
    omni: ModelSpec, video_workload: WorkloadSpec, h100x16: ClusterSpec
) -> None:
    plan = plan_training(omni, video_workload, h100x16)
    assert config_violations(omni, video_workload, h100x16, plan.config, 16) == []
    assert plan.memory.total <= h100x16.usable_bytes
    assert plan.binding_modality == "video"
    assert plan.step_time_s > 0
    strategies = {s.modality: s for s in plan.modalities}
    assert set(strategies) == {"text", "video"}
    if plan.cp > 1:
        assert "context parallel" in strategies["video"].approach
    assert "vision" in plan.encoder_placement and "audio" in plan.encoder_placement
    table = plan.table()
    assert "binding" in table and f"tp={plan.tp}" in table
