"""Model inputs: one prompt's token ids and media tensors, and batch collation.

The tensors are what the Qwen2.5-Omni thinker's forward takes (``pixel_values``, ``image_grid_thw``, ...),
so a prompt built by relax-modalities or by a transformers processor passes through unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import SupportsIndex

import numpy as np
import torch

from relax_services.models.tokens import TokenIds

_MEDIA_FIELDS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "video_second_per_grid",
    "input_features",
    "feature_attention_mask",
)


def audio_token_count(num_frames: int) -> int:
    """Audio placeholder tokens for ``num_frames`` log-mel frames (two stride-2 stages of the encoder)."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


@dataclass(frozen=True)
class OmniPrompt:
    """One chat prompt: token ids with media placeholders, and the media tensors that fill them.

    Attributes:
        input_ids: ``[T]`` int64 ids, ending with the chat template's generation prompt.
        pixel_values: ``[P_img, C·t·p·p]`` flattened image patches of all images, in prompt order.
        image_grid_thw: ``[n_img, 3]`` patch grid (t, h, w) per image.
        pixel_values_videos: ``[P_vid, C·t·p·p]`` flattened video patches.
        video_grid_thw: ``[n_vid, 3]`` patch grid per video.
        video_second_per_grid: ``[n_vid]`` seconds covered by one temporal grid step (required with video).
        input_features: ``[n_aud, n_mels, L]`` log-mel features per audio clip.
        feature_attention_mask: ``[n_aud, L]`` 1 on real frames.
    """

    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None
    input_features: torch.Tensor | None = None
    feature_attention_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        ids = torch.as_tensor(self.input_ids, dtype=torch.long)
        object.__setattr__(self, "input_ids", ids)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(f"OmniPrompt.input_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
        for kind, pixels, grid in (
            ("image", self.pixel_values, self.image_grid_thw),
            ("video", self.pixel_values_videos, self.video_grid_thw),
        ):
            if (pixels is None) != (grid is None):
                raise ValueError(f"OmniPrompt {kind}: pixels and grid must both be set")
            if pixels is not None and grid is not None and int(grid.prod(-1).sum()) != pixels.shape[0]:
                raise ValueError(
                    f"OmniPrompt {kind}: {pixels.shape[0]} patches, but grid {grid.tolist()} has "
                    f"{int(grid.prod(-1).sum())} patches"
                )
        if self.video_grid_thw is not None and (
            self.video_second_per_grid is None or len(self.video_second_per_grid) != len(self.video_grid_thw)
        ):
            raise ValueError("OmniPrompt.video_second_per_grid must give one value per video")
        if self.input_features is not None and (self.feature_attention_mask is None or self.input_features.ndim != 3):
            raise ValueError("OmniPrompt.input_features must be [n_aud, n_mels, L] with a feature_attention_mask")

    @property
    def num_tokens(self) -> int:
        """Prompt length in tokens, media placeholders included."""
        return int(self.input_ids.numel())

    def media(self) -> dict[str, torch.Tensor]:
        """The media tensors that are set, keyed by forward-kwarg name."""
        return {name: getattr(self, name) for name in _MEDIA_FIELDS if getattr(self, name) is not None}

    def fingerprint(self) -> bytes:
        """A content digest: equal for prompts with equal ids and media (dtype, shape and values)."""
        return tensors_digest({"input_ids": self.input_ids, **self.media()})

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[object, ...]:
        """Pickled as numpy arrays, when every tensor is a plain CPU one.

        Prompts cross processes at every queue hop. A tensor pickles through ``torch.save`` of its
        storage (≈ 170 µs out and 190 µs back for a prompt with one 56×56 image); numpy arrays take
        ≈ 14 µs and travel as out-of-band buffers. Anything else (a GPU tensor, one that requires
        grad) falls back to the default pickling.
        """
        values = [getattr(self, name) for name in _PROMPT_FIELDS]
        if all(t is None or _numpy_ready(t) for t in values):
            return _prompt_from_arrays, (tuple(None if t is None else t.numpy() for t in values),)
        return super().__reduce_ex__(protocol)


_PROMPT_FIELDS = ("input_ids", *_MEDIA_FIELDS)
_NUMPY_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool))


def _numpy_ready(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not t.requires_grad and t.dtype in _NUMPY_DTYPES and t.layout == torch.strided


def _prompt_from_arrays(arrays: tuple[np.ndarray | None, ...]) -> OmniPrompt:
    """The prompt :meth:`OmniPrompt.__reduce_ex__` pickled (its checks passed when it was built)."""
    prompt = object.__new__(OmniPrompt)
    for name, a in zip(_PROMPT_FIELDS, arrays, strict=True):
        # Arrays unpickled from a message or the object store may be read-only; tensors must own writable memory.
        value = None if a is None else torch.from_numpy(a if a.flags.writeable else a.copy())
        object.__setattr__(prompt, name, value)
    return prompt


def tensors_digest(tensors: dict[str, torch.Tensor]) -> bytes:
    """A 16-byte digest of named tensors' dtypes, shapes and values."""
    digest = hashlib.blake2b(digest_size=16)
    for name, t in tensors.items():
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.digest()


def check_placeholders(prompt: OmniPrompt, tokens: TokenIds) -> OmniPrompt:
    """Checks that ``prompt``'s placeholder counts match its media, with the checkpoint's placeholder ids.

    An image or video needs at least one placeholder and pixels for each of its ids (the model checks the exact
    count, which depends on the tower's merge size); audio needs exactly the encoder's output length.

    Returns:
        ``prompt``.

    Raises:
        ValueError: naming the modality and the counts.
    """
    ids = prompt.input_ids
    for kind, pixels in (("image", prompt.pixel_values), ("video", prompt.pixel_values_videos)):
        pad = tokens.placeholder(kind)
        n_tokens = 0 if pad is None else int((ids == pad).sum())
        if (n_tokens == 0) != (pixels is None):
            raise ValueError(
                f"OmniPrompt has {n_tokens} {kind} placeholder tokens; "
                f"{'pixels and grid must both be set' if pixels is None else 'but has ' + kind + ' pixels'}"
            )
    pad = tokens.placeholder("audio")
    n_audio = 0 if pad is None else int((ids == pad).sum())
    mask = prompt.feature_attention_mask
    if prompt.input_features is None or mask is None:
        if n_audio:
            raise ValueError(f"OmniPrompt has {n_audio} audio placeholder tokens but no input_features")
        return prompt
    expected = sum(audio_token_count(int(n)) for n in mask.sum(-1))
    if expected != n_audio:
        raise ValueError(f"OmniPrompt has {n_audio} audio placeholder tokens but its features need {expected}")
    return prompt


def text_prompt(input_ids: Sequence[int]) -> OmniPrompt:
    """A prompt without media."""
    return OmniPrompt(input_ids=torch.tensor(list(input_ids), dtype=torch.long))


def collate_media(prompts: Sequence[OmniPrompt]) -> dict[str, torch.Tensor]:
    """Concatenates the prompts' media in batch order, padding audio clips to the longest.

    The model scatters media features into the placeholders in row-major order of the batch, so the
    concatenation order here is what keeps each image with its prompt.

    Returns:
        Forward kwargs for the media present in at least one prompt.
    """
    out: dict[str, torch.Tensor] = {}
    for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "video_second_per_grid"):
        parts = [getattr(p, name) for p in prompts if getattr(p, name) is not None]
        if parts:
            out[name] = torch.cat(parts, dim=0)
    feats = [p.input_features for p in prompts if p.input_features is not None]
    masks = [p.feature_attention_mask for p in prompts if p.feature_attention_mask is not None]
    if feats:
        length = max(f.shape[-1] for f in feats)
        out["input_features"] = torch.cat(
            [torch.nn.functional.pad(f, (0, length - f.shape[-1])) for f in feats], dim=0
        )  # [n_aud, n_mels, L_max]
        out["feature_attention_mask"] = torch.cat(
            [torch.nn.functional.pad(m.long(), (0, length - m.shape[-1])) for m in masks], dim=0
        )  # [n_aud, L_max]
    return out


def pad_sequences(sequences: Sequence[torch.Tensor], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads 1-D id tensors to a batch.

    Args:
        sequences: ``B`` tensors of shape ``[T_i]``.
        pad_id: Fill id.
        side: ``"left"`` (prompts for decoding: all rows end at the same column) or ``"right"``.

    Returns:
        ``(input_ids [B, T], attention_mask [B, T])``.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    length = max(int(s.numel()) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        n = int(seq.numel())
        cols = slice(length - n, length) if side == "left" else slice(0, n)
        ids[i, cols] = seq
        mask[i, cols] = 1
    return ids, mask
