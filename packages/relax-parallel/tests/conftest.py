"""Shared fixtures: small hand-checkable models and the preset models."""

from __future__ import annotations

import pytest

from relax_parallel import ClusterSpec, ModelSpec, WorkloadSpec, load_model_spec


@pytest.fixture
def gpt() -> ModelSpec:
    """A GPT-style model matching the papers' assumptions: MHA, 4h ungated MLP, no biases."""
    return ModelSpec(
        name="gpt",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=32,
        ffn_hidden_size=16384,
        vocab_size=51200,
        gated_mlp=False,
        qkv_bias=False,
    )


@pytest.fixture
def omni() -> ModelSpec:
    return load_model_spec("qwen2.5-omni-7b")


@pytest.fixture
def video_workload() -> WorkloadSpec:
    return WorkloadSpec(modality_mix={"text": 0.7, "video": 0.3})


@pytest.fixture
def h100x16() -> ClusterSpec:
    return ClusterSpec(num_gpus=16, gpu_memory_gib=80)
