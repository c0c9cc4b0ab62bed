"""Video encoding split along time for sequence parallelism (``engines/fsdp/sequence_parallel.py``): which rank
encodes which temporal patch, and why the split is exact — the vision towers encode each temporal patch on its own,
so a video's features are its pieces' features in time order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from relax_services.engines.fsdp.sequence_parallel import time_shares
from relax_services.models import build_tiny_omni
from relax_services.models.modalities import MODEL_MODALITIES
from relax_services.models.tiny_families import write_tiny_checkpoint


@pytest.mark.parametrize(
    ("patches", "size", "ranks"),
    [
        ([16, 16], 2, [0, 1]),  # one video of two temporal patches: one each
        ([16, 16, 16], 2, [0, 0, 1]),  # 48 patches: the patch starting at 16 is in the first half (16 · 2 // 48 = 0)
        ([64, 16, 16], 2, [0, 1, 1]),  # a large first frame: 64 · 2 // 96 = 1
        ([16, 16, 16, 16], 4, [0, 1, 2, 3]),
        ([16], 4, [0]),  # fewer temporal patches than ranks: the others encode nothing
        ([], 2, []),
    ],
)
def test_time_shares_are_contiguous_and_balanced_by_patches(patches: list[int], size: int, ranks: list[int]) -> None:
    assert time_shares(patches, size) == ranks


def _tower(family: str, folder: Path) -> Any:
    if family == "qwen2.5-omni-thinker":
        return build_tiny_omni(0)
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(write_tiny_checkpoint(folder, family))


@pytest.mark.parametrize("family", ["qwen2.5-omni-thinker", "qwen2.5-vl"])
def test_a_videos_features_are_its_temporal_pieces_features_in_order(family: str, tmp_path: Path) -> None:
    """The tiny model's tower on a video of 4 temporal patches of 8 × 8 (Qwen2.5-VL's: 2 × 2 attention windows of
    4 × 4 patches and a full-attention block): the whole video against its patches encoded one by one and two by
    two. Bitwise on the CPU (the same operations on the same rows)."""
    model = _tower(family, tmp_path / family)
    video = MODEL_MODALITIES["video"]
    t, h, w = 4, 8, 8
    pixels = torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        [whole] = video.encode(model, {video.pixels: pixels, video.grid: torch.tensor([[t, h, w]])})
        for span in (1, 2):
            pieces = [
                video.encode(
                    model,
                    {
                        video.pixels: pixels[k * h * w : (k + span) * h * w],
                        video.grid: torch.tensor([[span, h, w]]),
                    },
                )[0]
                for k in range(0, t, span)
            ]
            assert torch.equal(torch.cat(pieces), whole)
    assert whole.shape[0] == t * h * w // 4  # 2 × 2 patches merge into one token
