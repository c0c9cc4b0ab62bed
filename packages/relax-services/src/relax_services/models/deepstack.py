"""DeepStack (Qwen3-VL): vision features of inner vision-tower layers added to the decoder's first hidden states.

A DeepStack family's vision tower returns, besides the merged features that replace the placeholder embeddings,
one more ``[tokens, H]`` feature map per listed tower layer (``deepstack_visual_indexes``); its text decoder adds
the ``k``-th map to the hidden states at the vision tokens after decoder layer ``k`` (DeepStack, Meng et al.
2024, arXiv:2406.04334). The model's own forward does this only when it encodes the pixels itself; relax encodes
each distinct media item once (:mod:`~relax_services.models.embeddings`) and runs the text decoder on input
embeddings, so it passes the maps itself: :class:`DeepstackFeatures` gathers them in the placeholders' order and
:func:`text_decoder` is the module that takes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from relax_services.models.families import family_of_model

__all__ = ["DeepstackFeatures", "text_decoder"]


def text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder relax runs on input embeddings (final hidden states, no LM head): the family's base
    model, or for a DeepStack family its language model (the one module that takes ``deepstack_visual_embeds``)."""
    base: Any = cast(Any, model).model  # every family's causal LM keeps its decoder here (typed loosely)
    decoder: torch.nn.Module = base.language_model if family_of_model(model).deepstack else base
    return decoder


class DeepstackFeatures:
    """A batch's DeepStack feature maps, scattered into the vision placeholders of its ``[B, T]`` ids.

    Args:
        input_ids: ``[B, T]`` padded ids.
        hidden_size: The decoder width.
        dtype: The embeddings' dtype.
    """

    def __init__(self, input_ids: torch.Tensor, hidden_size: int, dtype: torch.dtype) -> None:
        self._shape = (*input_ids.shape, hidden_size)
        self._device, self._dtype = input_ids.device, dtype
        self.visual = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)  # [B, T]
        self._layers: list[torch.Tensor] = []  # per DeepStack layer: [B, T, H], zero outside the vision tokens

    def add(self, mask: torch.Tensor, per_layer: Sequence[torch.Tensor]) -> None:
        """Adds one modality's maps.

        Args:
            mask: ``[B, T, 1]`` bool, the modality's placeholders.
            per_layer: For each DeepStack layer, ``[placeholders, H]`` features in the placeholders' row-major order.
        """
        if not self._layers:
            self._layers = [torch.zeros(self._shape, dtype=self._dtype, device=self._device) for _ in per_layer]
        if len(per_layer) != len(self._layers):
            raise ValueError(
                f"DeepStack: {len(per_layer)} feature maps where another modality gave {len(self._layers)}"
            )
        self._layers = [
            layer.masked_scatter(mask, feats.to(self._dtype))
            for layer, feats in zip(self._layers, per_layer, strict=True)
        ]
        self.visual = self.visual | mask[..., 0]

    def decoder_kwargs(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """``visual_pos_masks`` and ``deepstack_visual_embeds`` (each ``[vision tokens, H]``, in the row-major
        order of ``visual_pos_masks``, as the model's own forward builds them); empty without vision tokens."""
        if not self._layers:
            return {}
        return {"visual_pos_masks": self.visual, "deepstack_visual_embeds": [lay[self.visual] for lay in self._layers]}
