"""Shared fixtures: one synthetic task set per session, one tiny thinker per session."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from relax_modalities.synthetic import TaskItem, read_manifest, write_synthetic_tasks
from relax_modalities.text import TINY_VOCAB


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(scope="session")
def synthetic_manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_tasks(tmp_path_factory.mktemp("synthetic"), n_per_task=4, seed=7)


@pytest.fixture(scope="session")
def synthetic_items(synthetic_manifest: Path) -> list[TaskItem]:
    return read_manifest(synthetic_manifest)


@pytest.fixture(scope="session")
def tiny_thinker() -> Any:
    return build_tiny_thinker()


def build_tiny_thinker() -> Any:
    """The tiny thinker from DESIGN.md's field notes, random weights, eval mode."""
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    v = TINY_VOCAB
    cfg = Qwen2_5OmniThinkerConfig(
        text_config={
            "vocab_size": v.vocab_size,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 2, 2]},
            "pad_token_id": v.pad_id,
            "bos_token_id": v.bos_id,
            "eos_token_id": v.eos_id,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
        },
        audio_config={
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "d_model": 64,
            "output_dim": 64,
        },
        image_token_index=v.image_pad_id,
        video_token_index=v.video_pad_id,
        audio_token_index=v.audio_pad_id,
        audio_start_token_id=v.audio_start_id,
        audio_end_token_id=v.audio_end_id,
        user_token_id=v.user_id,
    )
    cfg.vision_start_token_id = v.vision_start_id
    cfg.vision_end_token_id = v.vision_end_id
    torch.manual_seed(0)
    model = Qwen2_5OmniThinkerForConditionalGeneration(cfg).eval()
    return model
