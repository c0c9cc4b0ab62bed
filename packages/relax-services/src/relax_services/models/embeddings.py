"""Input embeddings of a batch with each distinct media item encoded once.

A GRPO batch holds every prompt ``n`` times (one row per completion), often as separate copies after a
trip through the queue. The thinker's own forward would run the vision and audio towers on every copy;
here the media are deduplicated by content, encoded once, and their features scattered into the
placeholder positions of every row that uses them. Each registered modality (`MODEL_MODALITIES`) brings its
encoder call. Gradients of the copies add up in the shared
features, which is the same gradient as encoding each copy separately.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from relax_services.models.deepstack import DeepstackFeatures
from relax_services.models.families import family_of_model
from relax_services.models.inputs import OmniPrompt, tensors_digest
from relax_services.models.modalities import MODEL_MODALITIES, ModelModality, VisionModality

__all__ = ["MediaEncoder", "decoder_inputs", "embed_inputs", "encode_media"]


def _fingerprint(prompt: OmniPrompt, fields: Sequence[str]) -> bytes | None:
    media = prompt.media()
    if any(f not in media for f in fields):
        return None
    return tensors_digest({f: media[f] for f in fields})


def _split(per_item: Sequence[torch.Tensor], counts: Sequence[int]) -> list[torch.Tensor]:
    """Per-item features ``[tokens_j, H]`` regrouped per prompt (``counts[i]`` items each)."""
    out, start = [], 0
    for n in counts:
        out.append(torch.cat(list(per_item[start : start + n]), dim=0))
        start += n
    return out


MediaEncoder = Callable[
    [object, ModelModality, Sequence[OmniPrompt], torch.device, bool],
    tuple[list[torch.Tensor], list[list[torch.Tensor]]],
]
"""Encodes the media of one modality of some prompts: ``(model, modality, prompts, device, deepstack) → (features
per prompt, DeepStack features per layer per prompt)`` (:func:`encode_media`'s contract)."""


def encode_media(
    model: object, modality: ModelModality, prompts: Sequence[OmniPrompt], device: torch.device, deepstack: bool
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Features ``[tokens_i, H]`` of each prompt's media of one modality, in one encoder call, and (``deepstack``
    and a vision modality) per DeepStack layer the same per prompt; else that list is empty."""
    parts = [p.media_of(modality) for p in prompts]
    media = {k: v.to(device) for k, v in modality.collate(parts).items()}
    counts = [modality.num_items(part) for part in parts]
    if deepstack and isinstance(modality, VisionModality):
        per_item, layers = modality.encode_layers(model, media)
        return _split(per_item, counts), [_split(layer, counts) for layer in layers]
    return _split(modality.encode(model, media), counts), []


def decoder_inputs(
    model: torch.nn.Module,
    prompts: Sequence[OmniPrompt],
    input_ids: torch.Tensor,
    device: torch.device | str,
    encode: MediaEncoder = encode_media,
) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """The text decoder's inputs (:func:`~relax_services.models.deepstack.text_decoder`) for a padded batch:
    token embeddings with media features in the placeholders, each distinct media item encoded once, and for a
    DeepStack family the vision tokens' inner-layer features.

    Args:
        model: A model of a supported family.
        prompts: The ``B`` prompts of the rows (each row's placeholders are in its prompt part).
        input_ids: ``[B, T]`` padded ids on ``device``.
        device: Device of ``model``.
        encode: What encodes the distinct items of one modality (:func:`encode_media`; a sequence-parallel
            engine shares the work among its ranks).

    Returns:
        ``inputs_embeds`` ``[B, T, H]`` (without the media kwargs), plus ``visual_pos_masks`` and
        ``deepstack_visual_embeds`` for a DeepStack family's batch with vision tokens.
    """
    device = torch.device(device)
    deepstack = family_of_model(model).deepstack
    embed_tokens = cast(Any, model).get_input_embeddings()  # a transformers model: typed loosely
    embeds: torch.Tensor = embed_tokens(input_ids)  # [B, T, H]
    deep = DeepstackFeatures(input_ids, embeds.shape[-1], embeds.dtype)
    for kind, modality in MODEL_MODALITIES.items():
        rows = [
            (i, key) for i, p in enumerate(prompts) if (key := _fingerprint(p, modality.encoder_fields)) is not None
        ]
        if not rows:
            continue
        index_of: dict[bytes, int] = {}
        distinct: list[OmniPrompt] = []
        for i, key in rows:
            if key not in index_of:
                index_of[key] = len(distinct)
                distinct.append(prompts[i])
        features, layers = encode(model, modality, distinct, device, deepstack)
        source = torch.cat([features[index_of[key]] for _, key in rows], dim=0)  # [placeholders, H]
        mask = (input_ids == getattr(model.config, modality.token_attr))[..., None]  # [B, T, 1]
        if int(mask.sum()) != source.shape[0]:
            raise ValueError(f"{kind}: {int(mask.sum())} placeholder tokens but {source.shape[0]} feature rows")
        embeds = embeds.masked_scatter(mask, source.to(embeds.dtype))
        if layers:
            deep.add(mask, [torch.cat([layer[index_of[key]] for _, key in rows], dim=0) for layer in layers])
    return {"inputs_embeds": embeds, **deep.decoder_kwargs()}


def embed_inputs(
    model: torch.nn.Module, prompts: Sequence[OmniPrompt], input_ids: torch.Tensor, device: torch.device | str
) -> torch.Tensor:
    """Token embeddings with media features in the placeholders, each distinct media item encoded once
    (:func:`decoder_inputs`' ``inputs_embeds``; a DeepStack family's decoder needs the rest of them too).

    Returns:
        ``[B, T, H]`` embeddings to pass as ``inputs_embeds`` (without the media kwargs).
    """
    embeds = cast(torch.Tensor, decoder_inputs(model, prompts, input_ids, device)["inputs_embeds"])
    return embeds
