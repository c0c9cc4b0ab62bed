"""Rollout plan: decode time by hand, KV-bound concurrency, synchronous tail, infeasibility."""

from __future__ import annotations

import math

import pytest

from relax_parallel import (
    ClusterSpec,
    InfeasiblePlanError,
    WorkloadSpec,
    generation_estimate,
    load_model_spec,
    plan_rollout,
)

QWEN = load_model_spec("qwen2-7b")


def test_decode_step_is_weights_plus_kv_over_hbm_bandwidth() -> None:
    w = WorkloadSpec(prompt_tokens=512, response_tokens=1024, max_response_tokens=1024)
    cluster = ClusterSpec(num_gpus=1)
    est = generation_estimate(QWEN, w, cluster, tp=1, replicas=1, concurrency=1)
    context = 512 + 1024 / 2
    read = 2 * QWEN.llm_params() + context * (2 * 28 * 4 * 128 * 2)
    assert est.decode_step_s == pytest.approx(read / 3350e9)
    # One sequence at a time, all equally long: synchronous and continuous batching agree.
    assert est.sync_s == pytest.approx(est.async_s)
    assert est.sync_s == pytest.approx(est.prefill_s + 256 * 1024 * est.decode_step_s)


def test_long_tail_makes_synchronous_rollout_slower() -> None:
    w = WorkloadSpec(response_tokens=1024, max_response_tokens=8192)
    plan = plan_rollout(QWEN, w, ClusterSpec(num_gpus=8))
    assert plan.generation is not None
    assert plan.generation.sync_s > 2 * plan.generation.async_s
    assert plan.world_size == 8 and plan.tp * plan.dp == 8


def test_concurrency_is_bounded_by_kv_cache() -> None:
    w = WorkloadSpec(max_response_tokens=32768, prompts_per_step=64)
    cluster = ClusterSpec(num_gpus=1, gpu_memory_gib=80)
    plan = plan_rollout(QWEN, w, cluster)
    assert plan.generation is not None
    per_seq = (512 + 32768) * 2 * 28 * 4 * 128 * 2
    free = cluster.usable_bytes - 2 * QWEN.llm_params() - plan.memory.activations
    assert plan.generation.concurrency == math.floor(free / per_seq)
    assert plan.binding_constraint.startswith("memory: KV cache")
    assert plan.memory.total <= cluster.usable_bytes


def test_rollout_that_cannot_hold_weights_is_infeasible() -> None:
    with pytest.raises(InfeasiblePlanError, match="GiB over"):
        plan_rollout(QWEN, WorkloadSpec(), ClusterSpec(num_gpus=1, gpu_memory_gib=12))
