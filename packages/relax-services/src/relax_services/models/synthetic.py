"""Random-media prompts in the chat layout, for tests and throughput measurements (not a task).

Real prompts come from relax-modalities; these only have the right shapes: a 56 × 56 image (4 tokens),
a 2-frame 56 × 56 video clip (4 tokens), 1 s of audio features (100 frames, 25 tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from relax_services.models.inputs import OmniPrompt, audio_token_count
from relax_services.models.tokens import TokenIds

MODALITIES = ("text", "image", "video", "audio")
_PATCH_DIM = 3 * 2 * 14 * 14  # channels · temporal patch · patch · patch


def synthetic_prompt(
    modality: str,
    text_ids: Sequence[int],
    generator: torch.Generator | None = None,
    num_mel_bins: int = 128,
    audio_frames: int = 100,
    *,
    tokens: TokenIds | None = None,
) -> OmniPrompt:
    """Builds ``[media block] text`` with random media of the given modality (no chat turn around it).

    Args:
        modality: One of ``"text"``, ``"image"``, ``"video"``, ``"audio"``.
        text_ids: Prompt text ids placed after the media block.
        generator: RNG for the random media.
        num_mel_bins: Mel bins of the audio features.
        audio_frames: Log-mel frames of the audio clip (100 per second).
        tokens: Placeholder and marker ids; default: the default model's (``"tiny-omni"``).

    Returns:
        A validated prompt.
    """
    if modality not in MODALITIES:
        raise ValueError(f"modality must be one of {MODALITIES}, got {modality!r}")
    if tokens is None:
        from relax_services.models.checkpoint import DEFAULT_SOURCE, open_checkpoint

        tokens = open_checkpoint(DEFAULT_SOURCE).tokens
    ph = tokens.placeholders
    media: dict[str, torch.Tensor] = {}
    block: list[int] = []
    if modality == "image":
        grid = torch.tensor([[1, 4, 4]])
        media = {"pixel_values": torch.randn(16, _PATCH_DIM, generator=generator), "image_grid_thw": grid}
        block = [ph["vision_start"], *[ph["image"]] * 4, ph["vision_end"]]
    elif modality == "video":
        grid = torch.tensor([[2, 4, 4]])
        media = {
            "pixel_values_videos": torch.randn(32, _PATCH_DIM, generator=generator),
            "video_grid_thw": grid,
            "video_second_per_grid": torch.tensor([1.0]),
        }
        block = [ph["vision_start"], *[ph["video"]] * 8, ph["vision_end"]]
    elif modality == "audio":
        media = {
            "input_features": torch.randn(1, num_mel_bins, audio_frames, generator=generator),
            "feature_attention_mask": torch.ones(1, audio_frames, dtype=torch.long),
        }
        n = audio_token_count(audio_frames)
        block = [ph["audio_start"], *[ph["audio"]] * n, ph["audio_end"]]
    ids = torch.tensor([*block, *text_ids], dtype=torch.long)
    return OmniPrompt(input_ids=ids, **media)
