"""Model inputs: one prompt's token ids and media tensors, and batch collation.

The tensors are what the Qwen2.5-Omni thinker's forward takes (``pixel_values``, ``image_grid_thw``, ...),
so a prompt built by relax-modalities or by a transformers processor passes through unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import SupportsIndex

import numpy as np
import torch

from relax_services.models.modalities import MODEL_MODALITIES, ModelModality, audio_token_count, media_fields
from relax_services.models.tokens import TokenIds

__all__ = [
    "OmniPrompt",
    "audio_token_count",
    "check_placeholders",
    "collate_media",
    "join_media",
    "pad_sequences",
    "tensors_digest",
    "text_prompt",
]


class OmniPrompt:
    """One chat prompt: token ids with media placeholders, and the media tensors that fill them.

    The media tensors are the forward kwargs of the registered modalities (`MODEL_MODALITIES`), each read as an
    attribute (``None`` when not set); each modality checks its own at construction. The built-in ones:

    Attributes:
        input_ids: ``[T]`` int64 ids, ending with the chat template's generation prompt.
        pixel_values: ``[P_img, C·t·p·p]`` flattened image patches of all images, in prompt order.
        image_grid_thw: ``[n_img, 3]`` patch grid (t, h, w) per image.
        pixel_values_videos: ``[P_vid, C·t·p·p]`` flattened video patches.
        video_grid_thw: ``[n_vid, 3]`` patch grid per video.
        video_second_per_grid: ``[n_vid]`` seconds covered by one temporal grid step (required with video).
        input_features: ``[n_aud, n_mels, L]`` log-mel features per audio clip.
        feature_attention_mask: ``[n_aud, L]`` 1 on real frames.

    Raises:
        TypeError: a media kwarg no registered modality owns.
        ValueError: empty or non-1-D ids, or media tensors their modality rejects.
    """

    input_ids: torch.Tensor

    def __init__(self, input_ids: torch.Tensor | Sequence[int], **media: torch.Tensor | None) -> None:
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(f"OmniPrompt.input_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
        known = media_fields()
        unknown = sorted(set(media) - set(known))
        if unknown:
            raise TypeError(
                f"OmniPrompt got media field(s) {unknown} that no registered modality owns; "
                f"registered modalities' fields: {', '.join(known)}"
            )
        for modality in MODEL_MODALITIES.values():
            own = {f: t for f in modality.fields if (t := media.get(f)) is not None}
            if own:
                modality.validate(own)
        # Every registered field is an attribute (None when unset), in registry order.
        self.__dict__.update({"input_ids": ids, **{name: media.get(name) for name in known}})

    def __getattr__(self, name: str) -> torch.Tensor | None:
        """A field of a modality registered after this prompt was built: not set."""
        if name in media_fields():
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"OmniPrompt is immutable (cannot set {name!r})")

    def __repr__(self) -> str:
        shapes = "".join(f", {k}={tuple(v.shape)}" for k, v in self.media().items())
        return f"OmniPrompt(input_ids={self.input_ids.tolist()}{shapes})"

    @property
    def num_tokens(self) -> int:
        """Prompt length in tokens, media placeholders included."""
        return int(self.input_ids.numel())

    def media(self) -> dict[str, torch.Tensor]:
        """The media tensors that are set, keyed by forward-kwarg name (in registry order)."""
        return {name: t for name in media_fields() if (t := self.__dict__.get(name)) is not None}

    def media_of(self, modality: ModelModality) -> dict[str, torch.Tensor]:
        """The tensors of one modality that are set (empty when the prompt has none of it)."""
        return {name: t for name in modality.fields if (t := self.__dict__.get(name)) is not None}

    def fingerprint(self) -> bytes:
        """A content digest: equal for prompts with equal ids and media (dtype, shape and values)."""
        return tensors_digest({"input_ids": self.input_ids, **self.media()})

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[object, ...]:
        """Pickled as numpy arrays, when every tensor is a plain CPU one.

        Prompts cross processes at every queue hop. A tensor pickles through ``torch.save`` of its
        storage (≈ 170 µs out and 190 µs back for a prompt with one 56×56 image); numpy arrays take
        ≈ 14 µs and travel as out-of-band buffers. Anything else (a GPU tensor, one that requires
        grad) pickles as tensors.
        """
        values = {"input_ids": self.input_ids, **self.media()}
        if all(_numpy_ready(t) for t in values.values()):
            return _prompt_from_arrays, ({k: t.numpy() for k, t in values.items()},)
        return _prompt_from_tensors, (values,)


_NUMPY_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool))


def _numpy_ready(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not t.requires_grad and t.dtype in _NUMPY_DTYPES and t.layout == torch.strided


def _prompt_from_tensors(values: dict[str, torch.Tensor]) -> OmniPrompt:
    """The prompt :meth:`OmniPrompt.__reduce_ex__` pickled as tensors (its checks passed when it was built)."""
    prompt = object.__new__(OmniPrompt)
    prompt.__dict__.update({"input_ids": values["input_ids"], **{name: values.get(name) for name in media_fields()}})
    return prompt


def _prompt_from_arrays(arrays: dict[str, np.ndarray]) -> OmniPrompt:
    """The prompt :meth:`OmniPrompt.__reduce_ex__` pickled as arrays (its checks passed when it was built)."""
    # Arrays unpickled from a message or the object store may be read-only; tensors must own writable memory.
    return _prompt_from_tensors({k: torch.from_numpy(a if a.flags.writeable else a.copy()) for k, a in arrays.items()})


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
    for modality in MODEL_MODALITIES.values():
        pad = tokens.placeholder(modality.name)
        n_tokens = 0 if pad is None else int((prompt.input_ids == pad).sum())
        modality.check_placeholders(n_tokens, prompt.media_of(modality))
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
    return join_media([p.media() for p in prompts])


def join_media(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenates media kwargs in order, each modality as its `ModelModality.collate` joins items (audio clips
    padded to the longest): the media of several prompts of a batch, or of the turns of one multi-turn episode.

    Returns:
        Forward kwargs for the media present in at least one part.
    """
    out: dict[str, torch.Tensor] = {}
    for modality in MODEL_MODALITIES.values():
        own = [media for p in parts if (media := {f: t for f in modality.fields if (t := p.get(f)) is not None})]
        if own:
            out.update(modality.collate(own))
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
