"""Per-token log-probs and entropy of responses under a model: one padded forward per batch.

Used by the training engine (with grad) and by anything that rescores samples (reference model,
proximal log-probs) without grad.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from relax_services.engines.sampling import policy_logprobs
from relax_services.models import _vocab
from relax_services.models.embeddings import embed_inputs
from relax_services.models.inputs import OmniPrompt, pad_sequences
from relax_services.models.positions import sequence_positions
from relax_services.models.value import ValueModel


@dataclass
class TokenScores:
    """Scores of the response tokens of a batch, right-padded to the longest response.

    Attributes:
        logprobs: ``[B, L]`` log-prob of each response token (0 where ``mask`` is 0).
        entropy: ``[B, L]`` entropy of the policy distribution at each response position (0 where masked).
        mask: ``[B, L]`` float, 1 on real response tokens that are not suppressed ids.
        values: ``[B, L]`` critic values at each response position (value models only; their ``logprobs`` and
            ``entropy`` are zero).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor | None = None


@dataclass
class _ResponseForward:
    """The padded forward inputs of prompt + response rows, and where each response token sits in them."""

    model_kwargs: dict[str, torch.Tensor]
    cols: torch.Tensor  # [B, L] column whose output predicts response token j (prompt length - 1 + j)
    targets: torch.Tensor  # [B, L] response token ids (padding where masked)
    valid: torch.Tensor  # [B, L] bool: real, scored response tokens

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        prompts: Sequence[OmniPrompt],
        responses: Sequence[torch.Tensor],
        suppressed_ids: Sequence[int],
        device: torch.device | str,
    ) -> _ResponseForward:
        if len(prompts) != len(responses) or not prompts:
            raise ValueError(f"need as many responses as prompts (> 0), got {len(prompts)} and {len(responses)}")
        # Suppressed and media ids in a response are never scored; they are fed as padding so that a stray
        # placeholder id cannot be taken for media by the forward.
        banned = torch.tensor(sorted(set(suppressed_ids) | set(_vocab.MEDIA_IDS)), dtype=torch.long)
        kept = [~torch.isin(r.long().cpu(), banned) for r in responses]
        clean = [torch.where(k, r.long().cpu(), _vocab.PAD_ID) for r, k in zip(responses, kept, strict=True)]
        seqs = [torch.cat([p.input_ids, r]) for p, r in zip(prompts, clean, strict=True)]
        input_ids, attention_mask = pad_sequences(seqs, _vocab.PAD_ID, side="right")  # [B, T]
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        lengths = [int(r.numel()) for r in responses]
        positions, _ = sequence_positions(model, prompts, lengths, side="right")  # [3, B, T]
        # Media encoded once per distinct item (a group's rows share their prompt's media).
        embeds = embed_inputs(model, prompts, input_ids, device)  # [B, T, H]
        starts = torch.tensor([p.num_tokens for p in prompts], device=device)  # [B]
        steps = torch.arange(max(lengths), device=device)  # [L]
        kept_padded, _ = pad_sequences([k.long() for k in kept], 0, side="right")  # [B, L]
        # Outputs at column t predict the token at t + 1: response token j of row b sits at starts[b] + j.
        cols = (starts[:, None] - 1 + steps[None, :]).clamp_max(input_ids.shape[1] - 1)  # [B, L]
        targets = input_ids.gather(1, (cols + 1).clamp_max(input_ids.shape[1] - 1))  # [B, L]
        kwargs = {"inputs_embeds": embeds, "attention_mask": attention_mask, "position_ids": positions.to(device)}
        return cls(kwargs, cols, targets, kept_padded.to(device).bool())

    def pick(self, outputs: torch.Tensor) -> torch.Tensor:
        """``[B, T, D]`` per-column outputs → ``[B, L, D]`` at the response positions."""
        return outputs.gather(1, self.cols[..., None].expand(-1, -1, outputs.shape[-1]))


def score_responses(
    model: torch.nn.Module,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    temperature: float = 1.0,
    suppressed_ids: Sequence[int] = _vocab.SUPPRESSED_IDS,
    device: torch.device | str = "cpu",
) -> TokenScores:
    """Log-probs and entropy of each response given its prompt and media.

    The distribution is :func:`~relax_services.engines.sampling.policy_logprobs`: ``log_softmax(logits / T)``
    with suppressed ids removed from the support, the same one the rollout engine's behaviour log-probs
    refer to. Response tokens that are suppressed or media ids (padding included) are masked out.

    Args:
        model: A Qwen2.5-Omni thinker.
        prompts: ``B`` prompts.
        responses: ``B`` response id tensors ``[L_i]``.
        temperature: Temperature the responses were sampled at (0 means 1).
        suppressed_ids: Ids outside the support.
        device: Device of ``model``.

    Returns:
        Scores with grad if grad is enabled.
    """
    forward = _ResponseForward.build(model, prompts, responses, suppressed_ids, device)
    logits = model(**forward.model_kwargs).logits  # [B, T, V]
    picked = forward.pick(logits)  # [B, L, V]
    logp_all = policy_logprobs(picked, temperature, suppressed_ids)  # [B, L, V]
    token_logp = logp_all.gather(-1, forward.targets[..., None])[..., 0]  # [B, L]
    probs = logp_all.exp()
    entropy = -(probs * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)  # [B, L]
    valid = forward.valid
    zero = torch.zeros((), device=device)
    return TokenScores(
        logprobs=torch.where(valid, token_logp, zero),
        entropy=torch.where(valid, entropy, zero),
        mask=valid.float(),
    )


def score_values(
    model: ValueModel,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    suppressed_ids: Sequence[int] = _vocab.SUPPRESSED_IDS,
    device: torch.device | str = "cpu",
) -> TokenScores:
    """Critic values at each response position: ``values[b, j]`` is ``V`` of the state before response token
    ``j`` (the column whose policy logits predict it). Masking is :func:`score_responses`'.

    Returns:
        Scores with ``values`` set (with grad if grad is enabled); ``logprobs`` and ``entropy`` are zero.
    """
    forward = _ResponseForward.build(model.thinker, prompts, responses, suppressed_ids, device)
    hidden = forward.pick(model.hidden_states(**forward.model_kwargs))  # [B, L, H]
    values = model.value_head(hidden)[..., 0]  # [B, L]
    valid = forward.valid
    zeros = torch.zeros(valid.shape, device=device)
    return TokenScores(logprobs=zeros, entropy=zeros, mask=valid.float(), values=torch.where(valid, values, 0.0))
