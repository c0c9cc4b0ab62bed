"""Input embeddings of a batch with each distinct media item encoded once.

A GRPO batch holds every prompt ``n`` times (one row per completion), often as separate copies after a
trip through the queue. The thinker's own forward would run the vision and audio towers on every copy;
here the media are deduplicated by content, encoded once, and their features scattered into the
placeholder positions of every row that uses them. Gradients of the copies add up in the shared
features, which is the same gradient as encoding each copy separately.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from relax_services.models.inputs import OmniPrompt, audio_token_count, collate_media, tensors_digest

_KINDS = {
    # kind: (media fields, placeholder token id attribute of the config)
    "image": (("pixel_values", "image_grid_thw"), "image_token_id"),
    "video": (("pixel_values_videos", "video_grid_thw"), "video_token_id"),
    "audio": (("input_features", "feature_attention_mask"), "audio_token_id"),
}


def _fingerprint(prompt: OmniPrompt, fields: Sequence[str]) -> bytes | None:
    tensors = {f: getattr(prompt, f) for f in fields}
    if any(t is None for t in tensors.values()):
        return None
    return tensors_digest(tensors)


def _encode(model: Any, kind: str, prompts: Sequence[OmniPrompt], device: torch.device) -> list[torch.Tensor]:
    """Features ``[tokens_i, H]`` of each prompt's media of one kind, in one encoder call."""
    media = {k: v.to(device) for k, v in collate_media(prompts).items()}
    if kind == "image":
        per_item = model.get_image_features(media["pixel_values"], media["image_grid_thw"]).pooler_output
        counts = [len(p.image_grid_thw) for p in prompts if p.image_grid_thw is not None]
    elif kind == "video":
        per_item = model.get_video_features(media["pixel_values_videos"], media["video_grid_thw"]).pooler_output
        counts = [len(p.video_grid_thw) for p in prompts if p.video_grid_thw is not None]
    else:
        mask = media["feature_attention_mask"]
        flat = model.get_audio_features(media["input_features"], feature_attention_mask=mask).last_hidden_state
        per_item = torch.split(flat, [audio_token_count(int(n)) for n in mask.sum(-1)])
        counts = [len(p.feature_attention_mask) for p in prompts if p.feature_attention_mask is not None]
    out, start = [], 0
    for n in counts:
        out.append(torch.cat(list(per_item[start : start + n]), dim=0))
        start += n
    return out


def embed_inputs(
    model: Any, prompts: Sequence[OmniPrompt], input_ids: torch.Tensor, device: torch.device | str
) -> torch.Tensor:
    """Token embeddings with media features in the placeholders, each distinct media item encoded once.

    Args:
        model: A Qwen2.5-Omni thinker.
        prompts: The ``B`` prompts of the rows (each row's placeholders are in its prompt part).
        input_ids: ``[B, T]`` padded ids on ``device``.
        device: Device of ``model``.

    Returns:
        ``[B, T, H]`` embeddings to pass as ``inputs_embeds`` (without the media kwargs).
    """
    device = torch.device(device)
    embeds: torch.Tensor = model.get_input_embeddings()(input_ids)  # [B, T, H]
    for kind, (fields, token_attr) in _KINDS.items():
        rows = [(i, key) for i, p in enumerate(prompts) if (key := _fingerprint(p, fields)) is not None]
        if not rows:
            continue
        index_of: dict[bytes, int] = {}
        distinct: list[OmniPrompt] = []
        for i, key in rows:
            if key not in index_of:
                index_of[key] = len(distinct)
                distinct.append(prompts[i])
        features = _encode(model, kind, distinct, device)
        source = torch.cat([features[index_of[key]] for _, key in rows], dim=0)  # [placeholders, H]
        mask = (input_ids == getattr(model.config, token_attr))[..., None]  # [B, T, 1]
        if int(mask.sum()) != source.shape[0]:
            raise ValueError(f"{kind}: {int(mask.sum())} placeholder tokens but {source.shape[0]} feature rows")
        embeds = embeds.masked_scatter(mask, source.to(embeds.dtype))
    return embeds
