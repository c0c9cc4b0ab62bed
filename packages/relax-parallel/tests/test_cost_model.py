"""Memory and FLOP figures against hand-derived numbers and the papers' closed forms."""

from __future__ import annotations

import pytest

from relax_parallel import (
    ClusterSpec,
    ModelSpec,
    ParallelConfig,
    WorkloadSpec,
    kv_cache_bytes_per_token,
    layer_activation_bytes,
    layer_activation_coefficient,
    load_model_spec,
    pipeline_bubble_fraction,
    ring_allreduce_seconds,
    step_flops,
    training_memory,
    training_step_time,
)

TEXT = WorkloadSpec(prompt_tokens=1024, response_tokens=1024, max_response_tokens=1024)


def test_mixed_precision_adam_is_16_bytes_per_parameter(gpt: ModelSpec) -> None:
    cfg = ParallelConfig(distributed_optimizer=False)
    mem = training_memory(gpt, TEXT, cfg, "text")
    assert mem.model_states == 16 * gpt.llm_params()
    # Distributed optimizer over 8 data-parallel ranks: 2 + 2 + 12/8 = 5.5 bytes per parameter.
    sharded = training_memory(gpt, TEXT, ParallelConfig(dp=8), "text")
    assert sharded.model_states == pytest.approx(5.5 * gpt.llm_params())


def test_tensor_parallel_divides_model_states(gpt: ModelSpec) -> None:
    full = training_memory(gpt, TEXT, ParallelConfig(distributed_optimizer=False), "text")
    split = training_memory(gpt, TEXT, ParallelConfig(tp=4, distributed_optimizer=False), "text")
    # Layer norms are counted as split too; the discrepancy is below 1e-4 of the total.
    assert split.model_states == pytest.approx(full.model_states / 4, rel=1e-4)


def test_korthikanti_activation_formula(gpt: ModelSpec) -> None:
    s, b, h, a, t = 2048, 2, 4096, 32, 8
    # Korthikanti et al. 2022 eq. 1: s·b·h·(34 + 5·a·s/h) bytes per layer without parallelism.
    assert layer_activation_coefficient(gpt, s, flash_attention=False) == pytest.approx(34 + 5 * a * s / h)
    assert layer_activation_coefficient(gpt, s, flash_attention=True) == pytest.approx(34)
    no_flash = layer_activation_bytes(gpt, s, b, ParallelConfig(tp=t), flash_attention=False)
    assert no_flash == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)  # §4.2.2, TP + SP
    selective = layer_activation_bytes(gpt, s, b, ParallelConfig(tp=t, recompute="selective"), flash_attention=False)
    assert selective == pytest.approx(34 * s * b * h / t)  # §5, selective recomputation
    full = layer_activation_bytes(gpt, s, b, ParallelConfig(tp=t, recompute="full"))
    assert full == pytest.approx(2 * s * b * h / t)
    cp = layer_activation_bytes(gpt, s, b, ParallelConfig(tp=t, cp=4), flash_attention=True)
    assert cp == pytest.approx(34 * (s / 4) * b * h / t)


def test_gated_gqa_coefficient_by_hand() -> None:
    qwen = load_model_spec("qwen2-7b")
    # attention 7 + 4·kv/a, gated MLP 3 + 6·f/h, norms 4.
    expected = 7 + 4 * 4 / 28 + 3 + 6 * 18944 / 3584 + 4
    assert layer_activation_coefficient(qwen, 4096) == pytest.approx(expected)


def test_one_f_one_b_stage_zero_holds_all_layers_worth(gpt: ModelSpec) -> None:
    # Korthikanti §4.2.3: with m ≥ p, stage 0 stores p micro-batches of L/p layers = L layers' worth.
    per_layer = layer_activation_bytes(gpt, 2048, 1, ParallelConfig())
    for pp in (1, 2, 4):
        mem = training_memory(gpt, TEXT, ParallelConfig(pp=pp), "text")
        assert mem.activations == pytest.approx(gpt.num_layers * per_layer)


def test_training_flops_match_narayanan_closed_form(gpt: ModelSpec) -> None:
    B, s, l, h, V = TEXT.samples_per_step, 2048, 32, 4096, 51200  # noqa: E741 - the paper's symbols
    with_recompute = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    without = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert step_flops(gpt, TEXT, recompute="full") == pytest.approx(with_recompute, rel=1e-3)
    assert step_flops(gpt, TEXT) == pytest.approx(without, rel=1e-3)
    # Kaplan et al. 2020: 6·N·tokens plus the attention (s/6h) and LM-head (V/12lh) corrections.
    six_nd = 6 * 12 * l * h**2 * B * s
    assert step_flops(gpt, TEXT) / six_nd == pytest.approx(1 + s / (6 * h) + V / (12 * l * h), rel=1e-3)
    assert step_flops(gpt, TEXT, train=False) == pytest.approx(without / 3, rel=1e-3)


def test_pipeline_bubble_and_ring_allreduce() -> None:
    assert pipeline_bubble_fraction(4, 12) == pytest.approx(0.25)
    assert pipeline_bubble_fraction(1, 12) == 0
    # 2(n−1)/n of 1 GB at 100 GB/s, plus 2(n−1) latency steps.
    assert ring_allreduce_seconds(1e9, 4, 100.0) == pytest.approx(0.015)
    assert ring_allreduce_seconds(1e9, 4, 100.0, latency_s=1e-5) == pytest.approx(0.015 + 6e-5)
    assert ring_allreduce_seconds(1e9, 1, 100.0) == 0


def test_step_time_bubble_is_p_minus_one_over_m(gpt: ModelSpec) -> None:
    cluster = ClusterSpec(num_gpus=16)
    cfg = ParallelConfig(tp=2, pp=4, dp=2, micro_batch=4)
    t = training_step_time(gpt, TEXT, cluster, cfg, trainable_bytes=0.0)
    m = TEXT.samples_per_step // (2 * 4)
    assert t.bubble == pytest.approx(t.compute * 3 / m)
    assert t.compute == pytest.approx(step_flops(gpt, TEXT) / (16 * cluster.flops_per_s))
    assert t.tp_comm > 0 and t.pp_comm > 0 and t.cp_comm == 0 and t.ep_comm == 0


def test_kv_cache_bytes_per_token_qwen2() -> None:
    qwen = load_model_spec("qwen2-7b")
    assert kv_cache_bytes_per_token(qwen, 1) == 2 * 28 * 4 * 128 * 2
    assert kv_cache_bytes_per_token(qwen, 2) == 2 * 28 * 2 * 128 * 2
    # tp=8 > 4 KV heads: each rank keeps one replicated head.
    assert kv_cache_bytes_per_token(qwen, 8) == 2 * 28 * 1 * 128 * 2


def test_expert_parallel_splits_expert_weights() -> None:
    moe = load_model_spec("qwen3-omni-30b-a3b")
    text = WorkloadSpec()
    one = training_memory(moe, text, ParallelConfig(dp=8), "text")
    eight = training_memory(moe, text, ParallelConfig(dp=8, ep=8), "text")
    expected = 2 * moe.num_layers * moe.expert_params() * (1 - 1 / 8)
    assert one.weights - eight.weights == pytest.approx(expected)
