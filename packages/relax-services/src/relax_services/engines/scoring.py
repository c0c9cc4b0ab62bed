"""Per-token log-probs, entropy and values of responses under a model.

A GRPO batch holds each prompt once per completion, and prompts are far longer than the answers. So each
distinct prompt is run once (its media encoded once), its key/value cache is shared by the rows that
continue it, and only the response tokens run per row: the same numbers as one padded forward of every
``prompt + response`` row (to float rounding), at a fraction of the cost. Gradients of the rows add up in
the shared prompt computation, which is the gradient of the row-by-row forward.

Used by the training engine (with grad) and by anything that rescores samples (reference model,
proximal log-probs, critic values) without grad.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relax_services.engines.sampling import policy_logprobs
from relax_services.models.deepstack import text_decoder
from relax_services.models.embeddings import decoder_inputs
from relax_services.models.inputs import OmniPrompt, pad_sequences
from relax_services.models.positions import position_ids_for, sequence_positions
from relax_services.models.tokens import model_pad_id
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
        dist: ``[B, L, V]`` log-probs of the whole policy distribution at each response position (``-inf`` at
            suppressed ids; policy models only).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor | None = None
    dist: torch.Tensor | None = None


def distinct_prompts(prompts: Sequence[OmniPrompt]) -> tuple[list[OmniPrompt], torch.Tensor]:
    """Each distinct prompt once, and for every row the index of its prompt in that list.

    Rows of one group usually share one prompt object; copies made by a trip through the queue are matched
    by content (:meth:`OmniPrompt.fingerprint`), computed once per object.

    Returns:
        ``(distinct prompts in first-seen order, [B] int64 index)``.
    """
    by_object: dict[int, int] = {}
    by_content: dict[bytes, int] = {}
    distinct: list[OmniPrompt] = []
    index: list[int] = []
    for prompt in prompts:
        slot = by_object.get(id(prompt))
        if slot is None:
            slot = by_content.setdefault(prompt.fingerprint(), len(distinct))
            if slot == len(distinct):
                distinct.append(prompt)
            by_object[id(prompt)] = slot
        index.append(slot)
    return distinct, torch.tensor(index, dtype=torch.long)


@dataclass
class _ResponseStates:
    """Final decoder states at the response positions of a batch, and the tokens they predict."""

    hidden: torch.Tensor  # [B, L, H] the state whose LM-head output predicts response token j
    targets: torch.Tensor  # [B, L] response token ids (padding where masked)
    valid: torch.Tensor  # [B, L] bool: real, scored response tokens

    @classmethod
    def compute(
        cls,
        thinker: Any,
        prompts: Sequence[OmniPrompt],
        responses: Sequence[torch.Tensor],
        suppressed_ids: Sequence[int],
        device: torch.device | str,
    ) -> _ResponseStates:
        if len(prompts) != len(responses) or not prompts:
            raise ValueError(f"need as many responses as prompts (> 0), got {len(prompts)} and {len(responses)}")
        # Suppressed ids (media placeholders and markers among them) in a response are never scored; they are fed
        # as padding so that a stray placeholder id cannot be taken for media by the forward.
        pad_id = model_pad_id(thinker)
        banned = torch.tensor(sorted(suppressed_ids), dtype=torch.long)
        kept = [~torch.isin(r.long().cpu(), banned) for r in responses]
        clean = [torch.where(k, r.long().cpu(), pad_id) for r, k in zip(responses, kept, strict=True)]
        targets, response_mask = pad_sequences(clean, pad_id, side="right")  # [B, L]
        kept_padded, _ = pad_sequences([k.long() for k in kept], 0, side="right")  # [B, L]
        targets, response_mask = targets.to(device), response_mask.to(device)
        decoder = text_decoder(thinker)  # final hidden states, no LM head

        # Each distinct prompt once, left-padded so every prompt ends in the last column.
        distinct, row_prompt = distinct_prompts(prompts)
        row_prompt = row_prompt.to(device)
        ids, prompt_mask = pad_sequences([p.input_ids for p in distinct], pad_id, side="left")  # [U, P]
        ids, prompt_mask = ids.to(device), prompt_mask.to(device)
        positions, next_pos = sequence_positions(thinker, distinct, [0] * len(distinct), side="left")
        prefix = decoder(
            **decoder_inputs(thinker, distinct, ids, device),  # media encoded once per distinct item
            attention_mask=prompt_mask,
            position_ids=position_ids_for(thinker, positions.to(device)),  # [3, U, P] ([U, P] for 1-D families)
            use_cache=True,
        )
        hidden = prefix.last_hidden_state[row_prompt, -1:]  # [B, 1, H]: predicts response token 0
        length = targets.shape[1]
        if length > 1:  # response tokens 0 .. L-2, on each row's copy of its prompt's cache, predict 1 .. L-1
            cache = prefix.past_key_values
            cache.batch_select_indices(row_prompt)
            steps = torch.arange(length - 1, device=device)
            chunk = decoder(
                inputs_embeds=thinker.get_input_embeddings()(targets[:, :-1]),
                attention_mask=torch.cat([prompt_mask[row_prompt], response_mask[:, :-1]], dim=1),
                position_ids=position_ids_for(
                    thinker, (next_pos.to(device)[row_prompt, None] + steps).expand(3, -1, -1)
                ),
                past_key_values=cache,
                use_cache=True,
            )
            hidden = torch.cat([hidden, chunk.last_hidden_state], dim=1)  # [B, L, H]
        valid = kept_padded.to(device).bool() & response_mask.bool()
        return cls(hidden[:, :length], targets, valid)


def score_responses(
    model: torch.nn.Module,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    temperature: float = 1.0,
    suppressed_ids: Sequence[int] = (),
    device: torch.device | str = "cpu",
) -> TokenScores:
    """Log-probs and entropy of each response given its prompt and media.

    The distribution is :func:`~relax_services.engines.sampling.policy_logprobs`: ``log_softmax(logits / T)``
    with suppressed ids removed from the support, the same one the rollout engine's behaviour log-probs
    refer to. Response tokens that are suppressed or media ids (padding included) are masked out.

    Args:
        model: A model of a supported family (see ``relax_services.models.FAMILIES``).
        prompts: ``B`` prompts.
        responses: ``B`` response id tensors ``[L_i]``.
        temperature: Temperature the responses were sampled at (0 means 1).
        suppressed_ids: Ids outside the support: the checkpoint's never-sample ids (media placeholders included).
        device: Device of ``model``.

    Returns:
        Scores with grad if grad is enabled.
    """
    states = _ResponseStates.compute(model, prompts, responses, suppressed_ids, device)
    logits = model.lm_head(states.hidden)  # type: ignore[operator]  # [B, L, V]
    logp_all = policy_logprobs(logits, temperature, suppressed_ids)  # [B, L, V]
    token_logp = logp_all.gather(-1, states.targets[..., None])[..., 0]  # [B, L]
    probs = logp_all.exp()
    entropy = -(probs * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)  # [B, L]
    valid = states.valid
    zero = torch.zeros((), device=device)
    return TokenScores(
        logprobs=torch.where(valid, token_logp, zero),
        entropy=torch.where(valid, entropy, zero),
        mask=valid.float(),
        dist=logp_all,
    )


def score_values(
    model: ValueModel,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    suppressed_ids: Sequence[int] = (),
    device: torch.device | str = "cpu",
) -> TokenScores:
    """Critic values at each response position: ``values[b, j]`` is ``V`` of the state before response token
    ``j`` (the column whose policy logits predict it). Masking is :func:`score_responses`'.

    Returns:
        Scores with ``values`` set (with grad if grad is enabled); ``logprobs`` and ``entropy`` are zero.
    """
    states = _ResponseStates.compute(model.thinker, prompts, responses, suppressed_ids, device)
    values = model.value_head(states.hidden)[..., 0]  # [B, L]
    valid = states.valid
    zeros = torch.zeros(valid.shape, device=device)
    return TokenScores(logprobs=zeros, entropy=zeros, mask=valid.float(), values=torch.where(valid, values, 0.0))
