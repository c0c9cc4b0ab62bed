"""ModelSpec from transformers configs and presets; workload and cluster validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_parallel import PRESETS, ClusterSpec, WorkloadSpec, load_model_spec, model_spec_from_hf_config


def test_qwen2_7b_parameter_count_matches_hand_count() -> None:
    m = load_model_spec("qwen2-7b")
    h, f, v, layers, d = 3584, 18944, 152064, 28, 128
    attn = h * (28 + 2 * 4) * d + 28 * d * h + (28 + 2 * 4) * d
    per_layer = attn + 3 * h * f + 2 * h
    expected = layers * per_layer + 2 * v * h + h
    assert m.llm_params() == expected
    assert abs(expected / 7.62e9 - 1) < 0.01  # published: 7.62 B


def test_every_preset_loads_and_omni_models_have_encoders() -> None:
    for key in PRESETS:
        assert load_model_spec(key).total_params() > 1e9
    omni = load_model_spec("qwen2.5-omni-7b")
    assert omni.vision is not None and omni.audio is not None
    moe = load_model_spec("qwen3-omni-30b-a3b")
    assert moe.is_moe and moe.num_experts == 128 and moe.experts_top_k == 8
    # Qwen3-30B-A3B: ~30.5 B total, ~3.3 B active including embeddings (published "A3B").
    assert 30e9 < moe.llm_params() < 31e9
    assert 3.0e9 < moe.active_llm_params() + 2 * moe.vocab_size * moe.hidden_size < 3.6e9


def test_token_counts_match_design_field_notes() -> None:
    # DESIGN.md: with patch 14 and merge 2 a 56 × 56 image is 4 tokens; 1 s of audio is 25 tokens.
    omni = load_model_spec("qwen2.5-omni-7b")
    assert omni.vision is not None and omni.audio is not None
    assert omni.vision.llm_tokens(56, 56) == 4
    assert omni.audio.llm_tokens(1.0) == 25
    # Video: 128 frames / temporal patch 2 = 64 slices of (448/14)² = 1024 patches, /4 merged.
    assert omni.vision.llm_tokens(448, 448, frames=128) == 64 * 1024 // 4


def test_load_from_local_path_and_directory(tmp_path: Path) -> None:
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    by_dir = load_model_spec(tmp_path)
    by_file = load_model_spec(tmp_path / "config.json")
    assert by_dir == by_file
    assert by_dir.head_dim == 16 and by_dir.num_kv_heads == 2


def test_unknown_model_and_missing_field_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a preset"):
        load_model_spec(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="hidden_size"):
        model_spec_from_hf_config({"model_type": "qwen2", "num_hidden_layers": 2})


def test_workload_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"modality_mix.*sum to 1"):
        WorkloadSpec(modality_mix={"text": 0.5, "video": 0.3})
    with pytest.raises(ValueError, match="unknown modalities"):
        WorkloadSpec(modality_mix={"text": 0.5, "smell": 0.5})
    text_only = load_model_spec("qwen2-7b")
    with pytest.raises(ValueError, match="no encoder for 'video'"):
        WorkloadSpec(modality_mix={"video": 1.0}).sequence_tokens(text_only, "video")


def test_cluster_validation() -> None:
    with pytest.raises(ValueError, match="num_gpus"):
        ClusterSpec(num_gpus=12, gpus_per_node=8)
    c = ClusterSpec(num_gpus=16, gpu_memory_gib=80, usable_fraction=0.5)
    assert c.usable_bytes == 40 * 2**30
    assert c.link_gbps(8) == c.intra_node_gbps and c.link_gbps(16) == c.inter_node_gbps
