"""Rope positions of every family (3-D time/height/width for the Qwen VL and omni models, 1-D for text causal LMs),
with per-prompt caching. Always ``[3, B, T]``; :func:`position_ids_for` gives a model the form its forward takes.

Positions depend only on a prompt's token ids and media *shapes* (grids, seconds per grid, audio lengths),
never on pixel or audio values, and text after the last media block continues at ``max(previous) + 1``.
So the positions of ``prompt + k text tokens`` are the prompt's positions (computed once by the model's own
``get_rope_index`` and cached by structure) followed by ``next + 0 .. next + k − 1`` in all three
components. That replaces a per-row Python loop over every sequence of every batch.

Each registered modality (`MODEL_MODALITIES`) gives its part of the rule: the shapes its positions depend on (the
cache key) and its arguments to the family's ``get_rope_index``; a modality that gives none is positioned as text.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from relax_services.models.families import family_of_model
from relax_services.models.inputs import OmniPrompt
from relax_services.models.modalities import MODEL_MODALITIES

_CACHE_SIZE = 4096
_cache: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, int]] = OrderedDict()
_lock = threading.Lock()


def rope_positions(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, media: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """Rope positions of a padded batch, exactly as the model computes them (its ``get_rope_index``, or one index
    per real token for a 1-D family), with its family's arguments.

    Args:
        model: A model of a supported family.
        input_ids: ``[B, T]``.
        attention_mask: ``[B, T]`` 1 on real tokens; pads get position 1.
        media: The batch's media kwargs from :func:`~relax_services.models.collate_media`.

    Returns:
        ``[3, B, T]`` int64 positions.
    """
    kind = family_of_model(model).positions
    if kind == "1d":
        flat = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # [B, T]
        return flat[None].expand(3, -1, -1).clone()
    args: dict[str, object] = {}
    for modality in MODEL_MODALITIES.values():  # each modality's part of the family's rule
        args.update(modality.rope_args(kind, media))
    positions: torch.Tensor
    family_model = cast(Any, model)  # get_rope_index is the family's own method; transformers types it loosely
    if kind in ("vl-mrope", "vl3-mrope"):  # the VL families take per-token modality types
        cfg = family_model.config
        types = torch.zeros_like(input_ids, dtype=torch.int32)  # text 0; each modality's number (image 1, video 2)
        for modality in MODEL_MODALITIES.values():
            token = getattr(cfg, modality.token_attr, None)
            if modality.vl_token_type and token is not None:
                types[input_ids == token] = modality.vl_token_type
        if kind == "vl3-mrope":
            _check_frame_blocks(types, attention_mask, args.get("video_grid_thw"))
        positions, _ = family_model.model.get_rope_index(
            input_ids, mm_token_type_ids=types, attention_mask=attention_mask, **args
        )
        return positions
    positions, _ = family_model.get_rope_index(
        input_ids, attention_mask=attention_mask, use_audio_in_video=False, **args
    )
    return positions


def _check_frame_blocks(types: torch.Tensor, attention_mask: torch.Tensor, grids: object) -> None:
    """Qwen3-VL's rope takes one video grid row per frame block: each temporal grid step's tokens must be their own
    run (its processor writes ``<t seconds><vision_start> tokens <vision_end>`` per frame), else every position after
    the video is wrong. A prompt in the clip layout (one run per clip) is refused here.

    Raises:
        ValueError: naming the number of frames and of runs.
    """
    if not isinstance(grids, torch.Tensor) or grids.numel() == 0:
        return
    video = (types == 2) & attention_mask.bool()  # [B, T]
    runs = int((video[:, 1:] & ~video[:, :-1]).sum() + video[:, 0].sum())
    frames = int(grids[:, 0].sum())
    if runs != frames:
        raise ValueError(
            f"Qwen3-VL video: {frames} temporal grid steps but {runs} runs of video tokens; each step's tokens must "
            "be their own block, with its timestamp before it (relax's video path writes that layout when its "
            "VideoSettings.layout is 'timestamped_frames', as it is read from a Qwen3-VL checkpoint)"
        )


def _key(model: torch.nn.Module, prompt: OmniPrompt) -> tuple[object, ...]:
    cfg = model.config
    return (
        type(model).__name__,
        getattr(model, "spatial_merge_size", None),
        getattr(cfg, "position_id_per_seconds", None),
        getattr(cfg, "vision_start_token_id", None),
        getattr(cfg, "audio_start_token_id", None),
        prompt.input_ids.cpu().numpy().tobytes(),
        *((getattr(cfg, m.token_attr, None), m.structure(prompt.media_of(m))) for m in MODEL_MODALITIES.values()),
    )


def prompt_positions(model: torch.nn.Module, prompt: OmniPrompt) -> tuple[torch.Tensor, int]:
    """Positions of one prompt and the position of the token after it.

    Returns:
        ``([3, P] int64 positions, next position)``; the tensor is shared by the cache: do not modify it.
    """
    key = _key(model, prompt)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    ids = prompt.input_ids[None]  # [1, P]
    positions = rope_positions(model, ids, torch.ones_like(ids), prompt.media())[:, 0]  # [3, P]
    entry = (positions, int(positions.max()) + 1)
    with _lock:
        _cache[key] = entry
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return entry


def sequence_positions(
    model: torch.nn.Module, prompts: Sequence[OmniPrompt], suffix_lengths: Sequence[int], side: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of a padded batch of ``prompt_i + suffix_lengths[i]`` text tokens.

    Equal to :func:`rope_positions` on the same padded batch (pads get position 1), at a fraction of the cost.

    Args:
        model: A Qwen2.5-Omni thinker.
        prompts: ``B`` prompts.
        suffix_lengths: Text tokens after each prompt (response tokens; 0 for a prefill).
        side: Padding side, ``"left"`` or ``"right"``.

    Returns:
        ``(positions [3, B, T], next_positions [B])``: the position of the token after each sequence.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    lengths = [p.num_tokens + int(s) for p, s in zip(prompts, suffix_lengths, strict=True)]
    total = max(lengths)
    out = torch.ones(3, len(prompts), total, dtype=torch.long)  # [3, B, T]
    next_positions = torch.empty(len(prompts), dtype=torch.long)  # [B]
    for i, (prompt, suffix) in enumerate(zip(prompts, suffix_lengths, strict=True)):
        head, nxt = prompt_positions(model, prompt)  # [3, P]
        start = total - lengths[i] if side == "left" else 0
        out[:, i, start : start + prompt.num_tokens] = head
        out[:, i, start + prompt.num_tokens : start + lengths[i]] = torch.arange(nxt, nxt + int(suffix))
        next_positions[i] = nxt + int(suffix)
    return out, next_positions


def position_ids_for(model: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """``[3, B, T]`` positions in the form the model's forward takes: as they are for the 3-D rope families,
    ``[B, T]`` (one component; the three are equal) for a 1-D family."""
    return positions[0] if family_of_model(model).positions == "1d" else positions


def forward_media(model: torch.nn.Module, media: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collated media kwargs the family's forward takes: positions are always passed explicitly, so each
    modality's `ModelModality.position_fields` (the seconds per video grid) only matter to :func:`rope_positions`
    and are left out (the VL families' forward has no such argument; the omni thinker's reads it only to compute
    positions it is not given)."""
    only_positions = {f for m in MODEL_MODALITIES.values() for f in m.position_fields}
    return {k: v for k, v in media.items() if k not in only_positions}
