"""Tiny random checkpoints of every family, with the locally built tokenizer and chat template (tests, smoke runs).

Each is an ordinary checkpoint folder (``save_pretrained`` of model and tokenizer), so it goes through exactly the
loading, validation and engine code a real checkpoint of its family takes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import transformers

from relax_services.models.tiny_omni import write_tiny_omni
from relax_services.models.tiny_tokenizer import build_tiny_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["TINY_FAMILIES", "write_tiny_checkpoint"]

_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def _text_config(cls_name: str, tokenizer: PreTrainedTokenizerBase, **extra: object) -> PretrainedConfig:
    cls = getattr(transformers, cls_name)
    config: PretrainedConfig = cls(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.pad_token_id,
        **{"vocab_size": len(tokenizer), **_TEXT, "tie_word_embeddings": False, **extra},
    )
    return config


def _qwen2(tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    return transformers.Qwen2ForCausalLM(_text_config("Qwen2Config", tokenizer))  # type: ignore[no-untyped-call]


def _qwen3(tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    return transformers.Qwen3ForCausalLM(_text_config("Qwen3Config", tokenizer, head_dim=16))  # type: ignore[no-untyped-call]


def _llama(tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    # Tied input and output embeddings, as SmolLM2's (the one Llama-family checkpoint the examples train).
    config = _text_config("LlamaConfig", tokenizer, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)  # type: ignore[no-untyped-call]


def _qwen25_vl(tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    tid = cast("Callable[[str], int]", tokenizer.convert_tokens_to_ids)  # one token string: one id
    config = transformers.Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.pad_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
            **_TEXT,
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
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        image_token_id=tid("<|IMAGE|>"),
        video_token_id=tid("<|VIDEO|>"),
        vision_start_token_id=tid("<|vision_bos|>"),
        vision_end_token_id=tid("<|vision_eos|>"),
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(config)  # type: ignore[no-untyped-call]


def _qwen3_vl(tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    tid = cast("Callable[[str], int]", tokenizer.convert_tokens_to_ids)  # one token string: one id
    config = transformers.Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.pad_token_id,
            "head_dim": 16,
            # Qwen3-VL's interleaved multimodal rope, its sections scaled to head_dim 16 (published: [24, 20, 20]).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
            **_TEXT,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 64,  # an 8 × 8 learned grid, resampled to each image's
            "deepstack_visual_indexes": [0, 1],  # both tower layers feed the first two decoder layers
        },
        image_token_id=tid("<|IMAGE|>"),
        video_token_id=tid("<|VIDEO|>"),
        vision_start_token_id=tid("<|vision_bos|>"),
        vision_end_token_id=tid("<|vision_eos|>"),
    )
    return transformers.Qwen3VLForConditionalGeneration(config)  # type: ignore[no-untyped-call]


TINY_FAMILIES: dict[str, Callable[[PreTrainedTokenizerBase], PreTrainedModel]] = {
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "llama": _llama,
    "qwen2.5-vl": _qwen25_vl,
    "qwen3-vl": _qwen3_vl,
}
"""Family name → builder of a tiny random model of it (the omni thinker is :func:`write_tiny_omni`'s)."""

_PREPROCESSORS: dict[str, dict[str, object]] = {
    # Qwen3-VL's image processor settings as its published checkpoints ship them (patch 16, mean and std 0.5,
    # pixel budget 65536 .. 16777216), so the data path's reading of them is exercised by its tests.
    "qwen3-vl": {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    },
}
"""Family name → its tiny checkpoint's ``preprocessor_config.json`` (a family without one uses the defaults)."""

_VIDEO_PREPROCESSORS: dict[str, dict[str, object]] = {
    # Qwen3-VL's video processor settings in the keys Qwen3VLVideoProcessor reads: 2 fps within 4 .. 768 frames,
    # a clip budget of 4096 .. 25165824 px (so the clip, not the frame, is bounded), mean and std 0.5.
    "qwen3-vl": {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
    },
}
"""Family name → its tiny checkpoint's ``video_preprocessor_config.json`` (the video processor's own settings)."""

_EXTRA_CHARACTERS: dict[str, tuple[str, ...]] = {"qwen3-vl": ("<", ">")}  # its video timestamps: "<0.6 seconds>"
"""Family name → characters its tiny tokenizer adds to the default vocabulary."""

_TOKENIZER_FIELDS = frozenset({"pad_token_id", "eos_token_id", "bos_token_id"})
"""Config fields a ``shape`` cannot set: the tokenizer's special ids."""


def write_tiny_checkpoint(
    path: str | Path,
    family: str,
    seed: int = 0,
    *,
    hidden_size: int | None = None,
    shape: Mapping[str, object] | None = None,
) -> Path:
    """Writes a tiny random checkpoint of ``family`` (a :data:`TINY_FAMILIES` name or ``"qwen2.5-omni-thinker"``).

    Args:
        hidden_size: For ``qwen2`` only: another width (4 heads, FFN twice as wide), e.g. 128 for head_dim 32,
            the smallest vLLM's CPU attention takes.
        shape: For ``qwen2`` only: ``Qwen2Config`` fields that replace the tiny sizes, e.g. a published
            checkpoint's (``hidden_size``, ``num_hidden_layers``, ``tie_word_embeddings``, ``rope_parameters``, ...).
            The tokenizer and its special ids stay the tiny one's; a ``vocab_size`` at least its length pads the
            embedding and LM head with rows no token maps to, as published checkpoints do (Qwen2.5: 151,936 rows
            for 151,665 tokens), e.g. to measure what a real vocabulary costs.

    Raises:
        ValueError: for another family name, ``hidden_size`` or ``shape`` with another family than ``qwen2``, both
            of them, or a ``shape`` that sets a token id or a vocabulary smaller than the tokenizer.
    """
    path = Path(path)
    if hidden_size is not None and shape is not None:
        raise ValueError("write_tiny_checkpoint: give hidden_size or shape, not both")
    sizes = dict(shape or {})
    if hidden_size is not None:
        sizes = {"hidden_size": hidden_size, "intermediate_size": 2 * hidden_size}
    if sizes and family != "qwen2":
        raise ValueError(f"write_tiny_checkpoint: hidden_size and shape are for family 'qwen2' only, got {family!r}")
    if fixed := sorted(set(sizes) & _TOKENIZER_FIELDS):
        raise ValueError(f"write_tiny_checkpoint: shape cannot set {fixed}: they are the tiny tokenizer's")
    if family == "qwen2.5-omni-thinker":
        return write_tiny_omni(path, seed)
    if family not in TINY_FAMILIES:
        raise ValueError(f"no tiny checkpoint for family {family!r}; known: {[*TINY_FAMILIES, 'qwen2.5-omni-thinker']}")
    tokenizer = build_tiny_tokenizer(_EXTRA_CHARACTERS.get(family, ()))
    vocab = sizes.get("vocab_size", len(tokenizer))
    if not isinstance(vocab, int) or vocab < len(tokenizer):
        raise ValueError(
            f"write_tiny_checkpoint: shape vocab_size={vocab!r} must be an int >= the tiny tokenizer's {len(tokenizer)}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel
        if sizes:
            model = transformers.Qwen2ForCausalLM(_text_config("Qwen2Config", tokenizer, **sizes))  # type: ignore[no-untyped-call]
        else:
            model = TINY_FAMILIES[family](tokenizer)
    generation = model.generation_config
    generation.pad_token_id = tokenizer.pad_token_id
    generation.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if family in _PREPROCESSORS:
        (path / "preprocessor_config.json").write_text(json.dumps(_PREPROCESSORS[family], indent=2) + "\n")
    if family in _VIDEO_PREPROCESSORS:
        text = json.dumps(_VIDEO_PREPROCESSORS[family], indent=2) + "\n"
        (path / "video_preprocessor_config.json").write_text(text)
    return path
