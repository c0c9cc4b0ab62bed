"""Service split: hand-computed stage times, brute-force optimality, τ = 0, overlap bound."""

from __future__ import annotations

import itertools

import pytest

from relax_parallel import ClusterSpec, ModelSpec, Throughputs, WorkloadSpec, load_model_spec, split_services

QWEN = load_model_spec("qwen2-7b")
C16 = ClusterSpec(num_gpus=16)
MEASURED = Throughputs(rollout=1.0, trainer=2.0, reference=4.0)  # samples/s per GPU
WEIGHT_SYNC = 2 * QWEN.total_params() / 50e9  # bf16 weights over the 50 GB/s cross-node link


def _best_split(feasible: dict[str, tuple[int, ...]], rates: dict[str, float]) -> float:
    """Independent brute force: slowest stage of the best split of 16 GPUs over every feasible count."""
    return min(
        max(256 / (rates[s] * g) for s, g in zip(rates, counts, strict=True))
        for counts in itertools.product(*(feasible[s] for s in rates))
        if sum(counts) == 16
    )


def test_split_of_linearly_scaling_services_does_not_beat_running_in_turn() -> None:
    split = split_services(QWEN, WorkloadSpec(), C16, tau=2, measured=MEASURED)
    # 256 samples on 16 GPUs: rollout 16 s, trainer 8 s, reference 4 s in turn.
    assert split.sync_step_s == pytest.approx(28.0)
    assert split.overlap_bound == pytest.approx(28.0 / 16.0)
    best = _best_split(split.feasible_gpus, {"rollout": 1.0, "trainer": 2.0, "reference": 4.0})
    assert best > 28.0
    assert split.colocated and split.speedup == 1.0
    assert any(f"best split ({best + WEIGHT_SYNC:.2f} s" in line for line in split.explanation)


def test_measured_split_with_lock_step_tail_matches_brute_force() -> None:
    measured = Throughputs(rollout=1.0, trainer=2.0, reference=4.0, rollout_sync=0.5)
    split = split_services(QWEN, WorkloadSpec(), C16, tau=2, measured=measured)
    # In lock-step rollout takes 256 / (0.5 · 16) = 32 s, then 8 s + 4 s.
    assert split.sync_step_s == pytest.approx(44.0)
    assert split.overlap_bound == pytest.approx(44.0 / 32.0)
    best = _best_split(split.feasible_gpus, {"rollout": 1.0, "trainer": 2.0, "reference": 4.0})
    assert split.async_step_s == pytest.approx(best + WEIGHT_SYNC)
    assert split.speedup == pytest.approx(44.0 / (best + WEIGHT_SYNC))
    assert sum(split.gpus.values()) == 16 and not split.colocated
    for name, plan in split.plans.items():
        assert plan.world_size == split.gpus[name]


def test_tau_zero_runs_colocated() -> None:
    split = split_services(QWEN, WorkloadSpec(), C16, tau=0, measured=MEASURED)
    assert split.colocated and split.speedup == 1.0
    assert split.gpus == {"rollout": 16, "trainer": 16, "reference": 16}
    assert any("on-policy" in line for line in split.explanation)


def test_ppo_adds_a_critic_and_needs_its_throughput() -> None:
    with pytest.raises(ValueError, match="critic"):
        split_services(QWEN, WorkloadSpec(), C16, tau=1, algorithm="ppo", measured=MEASURED)
    with pytest.raises(ValueError, match="algorithm"):
        split_services(QWEN, WorkloadSpec(), C16, tau=1, algorithm="dpo")
    ppo = Throughputs(rollout=1.0, trainer=2.0, reference=4.0, critic=2.0)
    split = split_services(QWEN, WorkloadSpec(), C16, tau=1, algorithm="ppo", measured=ppo)
    assert set(split.gpus) == {"rollout", "trainer", "reference", "critic"}


def test_predicted_split_for_omni_reports_speedup_next_to_bound(
    omni: ModelSpec, video_workload: WorkloadSpec, h100x16: ClusterSpec
) -> None:
    split = split_services(omni, video_workload, h100x16, tau=2)
    assert not split.colocated
    assert split.speedup > 1.0
    assert split.overlap_bound >= 1.0
    assert split.async_step_s >= max(split.stage_seconds.values())
    table = split.table()
    assert "overlap bound" in table and "speedup" in table
