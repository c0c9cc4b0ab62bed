"""The critic: the policy's architecture with a scalar value head on the text decoder's last hidden state."""

from __future__ import annotations

import copy
from typing import Any

import torch


class ValueModel(torch.nn.Module):
    """``V(prompt, response[:j])`` for every response position ``j``, on a model of any supported family.

    Attributes:
        thinker: The backbone (media encoders and text decoder; its language-model head is unused).
        value_head: ``hidden_size → 1`` linear map of the final-norm hidden state.
    """

    def __init__(self, thinker: Any) -> None:
        super().__init__()
        self.thinker = thinker
        hidden = int(thinker.lm_head.in_features)  # the decoder width the LM head reads
        self.value_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.value_head.weight)  # starts at V ≡ 0: no value is assumed before any data
        torch.nn.init.zeros_(self.value_head.bias)

    def hidden_states(self, **model_kwargs: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]`` final hidden states of the text decoder (what the policy's LM head reads)."""
        hidden: torch.Tensor = self.thinker.model(**model_kwargs).last_hidden_state
        return hidden

    def forward(self, **model_kwargs: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` value at every column."""
        values: torch.Tensor = self.value_head(self.hidden_states(**model_kwargs))[..., 0]
        return values


def build_value_model(policy: torch.nn.Module) -> ValueModel:
    """A critic initialised from the policy's weights (a copy; the policy is not shared) and a zero value head."""
    return ValueModel(copy.deepcopy(policy))
