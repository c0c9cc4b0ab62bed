"""Building a ModelSpec from a transformers ``config.json`` (local file or shipped preset; no hub access)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from relax_parallel._specs import AudioEncoderSpec, ModelSpec, VisionEncoderSpec

# Preset id -> config file under relax_parallel/presets/ (written from published architecture numbers).
PRESETS: dict[str, str] = {
    "qwen2-7b": "qwen2-7b.json",
    "qwen2.5-vl-7b": "qwen2.5-vl-7b.json",
    "qwen2.5-omni-7b": "qwen2.5-omni-7b.json",
    "qwen3-omni-30b-a3b": "qwen3-omni-30b-a3b.json",
}

# Audio LLM tokens per second and encoder positions per second by model family: Qwen2.5-Omni pools the
# 50 Hz Whisper encoder output to 25 Hz; Qwen3-Omni's AuT encoder downsamples 8x to 12.5 Hz up front.
_AUDIO_RATES: dict[str, tuple[float, float]] = {
    "qwen2_5_omni": (50.0, 25.0),
    "qwen3_omni_moe": (12.5, 12.5),
}
_MEL_FRAMES_PER_SECOND = 100.0  # 10 ms hop, as WhisperFeatureExtractor


def _get(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise ValueError(f"config {where}: missing required field {key!r}")
    return cfg[key]


def _vision(cfg: Mapping[str, Any], llm_hidden: int) -> VisionEncoderSpec:
    where = "vision_config"
    return VisionEncoderSpec(
        depth=int(_get(cfg, "depth", where)),
        hidden_size=int(_get(cfg, "hidden_size", where)),
        ffn_hidden_size=int(_get(cfg, "intermediate_size", where)),
        num_heads=int(_get(cfg, "num_heads", where)),
        patch_size=int(cfg.get("patch_size", 14)),
        spatial_merge_size=int(cfg.get("spatial_merge_size", 2)),
        temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
        out_hidden_size=int(cfg.get("out_hidden_size", llm_hidden)),
        gated_mlp=str(cfg.get("hidden_act", "silu")) == "silu",
    )


def _audio(cfg: Mapping[str, Any], family: str, llm_hidden: int) -> AudioEncoderSpec:
    where = "audio_config"
    encoder_fps, tokens_per_s = _AUDIO_RATES.get(family, (50.0, 25.0))
    n_window = int(cfg.get("n_window", 100))
    return AudioEncoderSpec(
        num_layers=int(_get(cfg, "encoder_layers", where)),
        hidden_size=int(_get(cfg, "d_model", where)),
        ffn_hidden_size=int(_get(cfg, "encoder_ffn_dim", where)),
        num_heads=int(_get(cfg, "encoder_attention_heads", where)),
        num_mel_bins=int(cfg.get("num_mel_bins", 128)),
        encoder_frames_per_second=encoder_fps,
        tokens_per_second=tokens_per_s,
        chunk_seconds=2 * n_window / _MEL_FRAMES_PER_SECOND,
        out_hidden_size=int(cfg.get("output_dim", llm_hidden)),
    )


def model_spec_from_hf_config(config: Mapping[str, Any], name: str = "") -> ModelSpec:
    """Build a ModelSpec from a parsed transformers config.

    Understands flat decoder configs (Qwen2), VL configs with a ``vision_config`` (Qwen2.5-VL; text fields at
    the top level or under ``text_config``), and omni configs whose ``thinker_config`` holds
    ``text_config``/``vision_config``/``audio_config`` (Qwen2.5-Omni, Qwen3-Omni-MoE). For omni models the
    thinker is planned; the talker (speech output) is not trained by RL here.

    Args:
        config: The parsed ``config.json``.
        name: Display name; defaults to the config's ``model_type``.

    Returns:
        The model description.

    Raises:
        ValueError: A required field is missing.
    """
    family = str(config.get("model_type", ""))
    root = config.get("thinker_config", config)
    text = root.get("text_config", root)
    where = "text_config" if "text_config" in root else "(top level)"
    hidden = int(_get(text, "hidden_size", where))
    num_experts = int(text.get("num_experts", 0))
    if num_experts and (text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1)) != 1):
        raise ValueError("config: MoE models with dense layers interleaved are not supported by the planner")
    vision = root.get("vision_config")
    audio = root.get("audio_config")
    return ModelSpec(
        name=name or family or "model",
        num_layers=int(_get(text, "num_hidden_layers", where)),
        hidden_size=hidden,
        num_heads=int(_get(text, "num_attention_heads", where)),
        num_kv_heads=int(text.get("num_key_value_heads", text["num_attention_heads"])),
        ffn_hidden_size=int(_get(text, "intermediate_size", where)),
        vocab_size=int(_get(text, "vocab_size", where)),
        head_dim=int(text.get("head_dim") or 0),
        gated_mlp=str(text.get("hidden_act", "silu")) == "silu",
        # Qwen2 has Q/K/V biases; Qwen3 replaced them with QK-norm.
        qkv_bias=bool(text.get("attention_bias", not family.startswith("qwen3"))),
        tied_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        num_experts=num_experts,
        experts_top_k=int(text.get("num_experts_per_tok", 0)) if num_experts else 0,
        moe_ffn_hidden_size=int(text.get("moe_intermediate_size", 0)) if num_experts else 0,
        vision=_vision(vision, hidden) if vision else None,
        audio=_audio(audio, family, hidden) if audio else None,
    )


def load_model_spec(model: str | Path) -> ModelSpec:
    """Load a ModelSpec from a preset id, a ``config.json`` path, or a directory holding one.

    Args:
        model: A key of ``PRESETS`` (e.g. ``"qwen2.5-omni-7b"``) or a local path.

    Returns:
        The model description.

    Raises:
        ValueError: Neither a preset nor an existing path.
    """
    key = str(model)
    if key in PRESETS:
        text = resources.files("relax_parallel").joinpath("presets", PRESETS[key]).read_text()
        return model_spec_from_hf_config(json.loads(text), name=key)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model {key!r}: not a preset ({', '.join(PRESETS)}) and no config.json at {path}")
    return model_spec_from_hf_config(json.loads(path.read_text()), name=path.parent.name or key)
