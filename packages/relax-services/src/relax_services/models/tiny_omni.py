"""The default policy: a Qwen2.5-Omni thinker of ≈0.43 M parameters, written once as an ordinary checkpoint folder.

:func:`tiny_omni_checkpoint` writes the model (random weights from a seed), its locally built tokenizer with a
chat template, its generation config and its preprocessor config into a cache folder, and every later run reads
that folder back through :func:`~relax_services.models.checkpoint.open_checkpoint`, the path a user's checkpoint
takes. No token id is fixed here: every id is read from the tokenizer this module builds.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import safetensors.torch
import torch
from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoderConfig,
    Qwen2_5OmniTextConfig,
    Qwen2_5OmniVisionEncoderConfig,
)

from relax_services.models._light import cache_dir  # light: the driver reads it without this module
from relax_services.models.tiny_tokenizer import build_tiny_tokenizer

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedTokenizerBase

__all__ = [
    "OmniModel",
    "TinyOmniConfig",
    "build_tiny_omni",
    "cache_dir",
    "num_parameters",
    "tiny_omni_checkpoint",
    "write_tiny_omni",
]

OmniModel = Qwen2_5OmniThinkerForConditionalGeneration
"""The class of the default model."""

_FORMAT = 3  # bump when the folder's content changes, so old cache folders are not reused


@dataclass(frozen=True)
class TinyOmniConfig:
    """Shape of the tiny omni thinker; the defaults are the measured ≈0.43 M-parameter model of DESIGN.md.

    The vocabulary and every special id come from the tokenizer (:func:`build_tiny_tokenizer`).

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

    def to_hf_config(self, tokenizer: PreTrainedTokenizerBase) -> Qwen2_5OmniThinkerConfig:
        """Builds the transformers thinker config; every special-token id is looked up in ``tokenizer``."""
        tid = cast("Callable[[str], int]", tokenizer.convert_tokens_to_ids)  # one token string: one id
        text = Qwen2_5OmniTextConfig(
            vocab_size=len(tokenizer),
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
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.pad_token_id,  # Qwen's tokenizers have no bos; its configs name <|endoftext|>
            eos_token_id=tokenizer.eos_token_id,
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
            audio_token_index=tid("<|AUDIO|>"),
            image_token_index=tid("<|IMAGE|>"),
            video_token_index=tid("<|VIDEO|>"),
            audio_start_token_id=tid("<|audio_bos|>"),
            audio_end_token_id=tid("<|audio_eos|>"),
            user_token_id=tid("user"),
        )
        # Not constructor fields of the thinker config, but read by its rope-index computation.
        config.vision_start_token_id = tid("<|vision_bos|>")
        config.vision_end_token_id = tid("<|vision_eos|>")
        config._attn_implementation = self.attn_implementation
        return config

    def preprocessor_config(self) -> dict[str, Any]:
        """``preprocessor_config.json``: Qwen2.5-Omni's image processor and Whisper feature extractor settings,
        with this model's patch geometry and mel bins (the other values are the processors' own defaults)."""
        return {
            "processor_class": "Qwen2_5OmniProcessor",
            "image_processor_type": "Qwen2VLImageProcessor",
            "feature_extractor_type": "WhisperFeatureExtractor",
            "patch_size": self.patch_size,
            "merge_size": self.spatial_merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": 56 * 56,
            "max_pixels": 28 * 28 * 1280,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "feature_size": self.num_mel_bins,
            "sampling_rate": 16000,
            "n_fft": 400,
            "hop_length": 160,
            "chunk_length": 30,
            "padding_value": 0.0,
            "return_attention_mask": True,
        }


def write_tiny_omni(path: str | Path, seed: int = 0, config: TinyOmniConfig | None = None) -> Path:
    """Writes the tiny omni thinker as a checkpoint folder: weights (safetensors), ``config.json``,
    ``generation_config.json``, the tokenizer with its chat template, and ``preprocessor_config.json``.

    Args:
        path: Folder to write (created).
        seed: Seeds the weight initialisation (the global torch RNG state is left as it was).
        config: Model shape; defaults to :class:`TinyOmniConfig` ().

    Returns:
        ``path``.
    """
    config = config or TinyOmniConfig()
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = OmniModel(config.to_hf_config(tokenizer))
    generation = model.generation_config
    generation.pad_token_id = tokenizer.pad_token_id
    generation.bos_token_id = tokenizer.pad_token_id
    generation.eos_token_id = tokenizer.eos_token_id
    # Not model.save_pretrained: under an initialised process group (an FSDP rank building its model) it writes
    # the weights on rank 0 only, and the other ranks' folders would be left without config or weights.
    path.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    generation.save_pretrained(path)
    safetensors.torch.save_model(model, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(config.preprocessor_config(), indent=2) + "\n")
    return path


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def tiny_omni_checkpoint(seed: int = 0, config: TinyOmniConfig | None = None) -> Path:
    """The default checkpoint folder for ``seed``, written on first use under :func:`cache_dir`.

    The folder's name digests the shape, the seed and the format, so a changed default never reuses an old folder.
    Concurrent first uses (several processes of one run) are safe: each writes a private folder and renames it
    into place; the first rename wins and the others are discarded.
    """
    config = config or TinyOmniConfig()
    key = json.dumps({"format": _FORMAT, "seed": seed, **asdict(config)}, sort_keys=True)
    folder = cache_dir() / "models" / f"tiny-omni-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if _complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write_tiny_omni(tmp, seed, config)
        if not _complete(tmp):
            raise RuntimeError(f"writing the default checkpoint into {tmp} left it without config or weights")
        try:
            tmp.rename(folder)
        except OSError as exc:  # another process renamed its copy first
            if not _complete(folder):
                raise RuntimeError(
                    f"an incomplete default checkpoint folder {folder} is in the way; remove it"
                ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def build_tiny_omni(seed: int = 0, config: TinyOmniConfig | None = None) -> OmniModel:
    """The default model for ``seed``: its checkpoint folder (written once) loaded like any user checkpoint."""
    from relax_services.models.checkpoint import load_model

    model: OmniModel = load_model(tiny_omni_checkpoint(seed, config))
    return model


def num_parameters(model: torch.nn.Module) -> int:
    """Counts distinct parameters (tied weights once)."""
    return sum(p.numel() for p in model.parameters())
