"""The default policy: a Qwen2.5-Omni thinker of ≈0.43 M parameters, built offline from a config in code.

Any local transformers checkpoint directory of the same architecture goes through :func:`load_model`, so the
engines never special-case the tiny model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoderConfig,
    Qwen2_5OmniTextConfig,
    Qwen2_5OmniVisionEncoderConfig,
)

from relax_services.models import _vocab

OmniModel = Qwen2_5OmniThinkerForConditionalGeneration
"""The model class every engine drives (ids in, logits out)."""


@dataclass(frozen=True)
class TinyOmniConfig:
    """Shape of the tiny omni thinker; the defaults are the measured ≈0.43 M-parameter model of DESIGN.md.

    Token ids are not configurable: they are fixed by the shared 64-token vocabulary.

    Attributes:
        hidden_size: Text decoder width; also the vision and audio encoders' output width.
        num_layers: Text decoder layers.
        num_heads: Text attention heads; ``hidden_size / num_heads`` is the head dim.
        num_kv_heads: Key/value heads (grouped-query attention); must divide ``num_heads``.
        ffn_size: Text MLP intermediate size.
        mrope_section: Multimodal rope split of the rotary half-dims over (time, height, width);
            must sum to ``head_dim / 2``.
        rope_theta: Rotary base.
        max_position_embeddings: Largest position id the model is meant for.
        vision_depth: Vision transformer blocks.
        vision_hidden_size: Vision transformer width.
        vision_heads: Vision attention heads.
        vision_ffn_size: Vision MLP intermediate size.
        patch_size: Vision patch side in pixels.
        spatial_merge_size: Patches merged per side into one vision token (a 56 × 56 image is 4 tokens).
        temporal_patch_size: Frames per temporal patch (images are repeated to this many frames).
        audio_layers: Audio encoder layers.
        audio_d_model: Audio encoder width.
        audio_heads: Audio attention heads.
        audio_ffn_size: Audio MLP intermediate size.
        num_mel_bins: Log-mel bins of the audio features (``WhisperFeatureExtractor(feature_size=...)``).
        attn_implementation: transformers attention backend, ``"sdpa"`` or ``"eager"``.
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_size: int = 128
    mrope_section: tuple[int, int, int] = field(default=(4, 2, 2))
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    vision_depth: int = 2
    vision_hidden_size: int = 64
    vision_heads: int = 4
    vision_ffn_size: int = 128
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    audio_layers: int = 2
    audio_d_model: int = 64
    audio_heads: int = 4
    audio_ffn_size: int = 128
    num_mel_bins: int = 128
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size", "vision_depth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TinyOmniConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TinyOmniConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TinyOmniConfig.num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        half_head_dim = self.hidden_size // self.num_heads // 2
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != half_head_dim:
            raise ValueError(
                f"TinyOmniConfig.mrope_section {tuple(self.mrope_section)} must be 3 ints summing to "
                f"head_dim / 2 = {half_head_dim}"
            )
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(
                f"TinyOmniConfig.attn_implementation must be 'sdpa' or 'eager', got {self.attn_implementation!r}"
            )

    def to_hf_config(self) -> Qwen2_5OmniThinkerConfig:
        """Builds the transformers thinker config, with every special-token id the model reads set."""
        text = Qwen2_5OmniTextConfig(
            vocab_size=_vocab.VOCAB_SIZE,
            hidden_size=self.hidden_size,
            intermediate_size=self.ffn_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "mrope_section": list(self.mrope_section),
            },
            pad_token_id=_vocab.PAD_ID,
            bos_token_id=_vocab.BOS_ID,
            eos_token_id=_vocab.EOS_ID,
        )
        vision = Qwen2_5OmniVisionEncoderConfig(
            depth=self.vision_depth,
            hidden_size=self.vision_hidden_size,
            intermediate_size=self.vision_ffn_size,
            num_heads=self.vision_heads,
            patch_size=self.patch_size,
            spatial_merge_size=self.spatial_merge_size,
            temporal_patch_size=self.temporal_patch_size,
            out_hidden_size=self.hidden_size,
            # Full attention in the last block; indexes beyond the depth would be silently ignored.
            fullatt_block_indexes=[self.vision_depth - 1],
        )
        audio = Qwen2_5OmniAudioEncoderConfig(
            num_mel_bins=self.num_mel_bins,
            encoder_layers=self.audio_layers,
            encoder_attention_heads=self.audio_heads,
            encoder_ffn_dim=self.audio_ffn_size,
            d_model=self.audio_d_model,
            output_dim=self.hidden_size,
        )
        config = Qwen2_5OmniThinkerConfig(
            audio_config=audio,
            vision_config=vision,
            text_config=text,
            audio_token_index=_vocab.AUDIO_PAD_ID,
            image_token_index=_vocab.IMAGE_PAD_ID,
            video_token_index=_vocab.VIDEO_PAD_ID,
            audio_start_token_id=_vocab.AUDIO_START_ID,
            audio_end_token_id=_vocab.AUDIO_END_ID,
            user_token_id=_vocab.USER_ID,
        )
        # Not constructor fields of the thinker config, but read by its rope-index computation.
        config.vision_start_token_id = _vocab.VISION_START_ID
        config.vision_end_token_id = _vocab.VISION_END_ID
        config._attn_implementation = self.attn_implementation
        return config


def build_tiny_omni(seed: int = 0, config: TinyOmniConfig | None = None) -> OmniModel:
    """Builds the tiny omni thinker with deterministic random weights; no download.

    Args:
        seed: Seeds the weight initialisation (the global torch RNG state is restored afterwards).
        config: Model shape; defaults to :class:`TinyOmniConfig` ().

    Returns:
        The model in eval mode, float32, on CPU, with its generation config's pad/bos/eos set.
    """
    config = config or TinyOmniConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = OmniModel(config.to_hf_config())
    generation = model.generation_config
    generation.pad_token_id = _vocab.PAD_ID
    generation.bos_token_id = _vocab.BOS_ID
    generation.eos_token_id = _vocab.EOS_ID
    torch.nn.Module.eval(model)
    return model


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> OmniModel:
    """Loads a Qwen2.5-Omni thinker from a local transformers checkpoint directory (``save_pretrained``).

    Args:
        path: Directory holding ``config.json`` and the weights; nothing is downloaded.
        dtype: Parameter dtype to load in.

    Returns:
        The model in eval mode.

    Raises:
        FileNotFoundError: If ``path`` is not a directory with a ``config.json``.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a transformers checkpoint directory (no config.json)")
    model: OmniModel = OmniModel.from_pretrained(path, dtype=dtype, local_files_only=True)
    torch.nn.Module.eval(model)
    return model


def num_parameters(model: torch.nn.Module) -> int:
    """Counts distinct parameters (tied weights once)."""
    return sum(p.numel() for p in model.parameters())
