"""Per-token log-probs, entropy and values of responses under a model.

A GRPO batch holds each prompt once per completion, and prompts are far longer than the answers. So each
distinct prompt is run once (its media encoded once), its key/value cache is shared by the rows that
continue it, and only the response tokens run per row: the same numbers as one padded forward of every
``prompt + response`` row (to float rounding), at a fraction of the cost. Gradients of the rows add up in
the shared prompt computation, which is the gradient of the row-by-row forward.

The LM head runs over the response states a chunk of tokens at a time (:func:`token_scores`): a real
vocabulary makes the ``[B, L, V]`` logits of a batch tens of GB, and only the target token's log-prob and the
entropy leave each chunk. The whole distribution is built only when asked for (``with_dist``).

Used by the training engine (with grad) and by anything that rescores samples (reference model,
proximal log-probs, critic values) without grad.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from relax_services.engines.progress import tick
from relax_services.engines.sampling import policy_logprobs
from relax_services.models.deepstack import text_decoder
from relax_services.models.embeddings import decoder_inputs
from relax_services.models.inputs import OmniPrompt, pad_sequences
from relax_services.models.positions import position_ids_for, sequence_positions
from relax_services.models.tokens import model_pad_id
from relax_services.models.value import ValueModel

SCORING_CHUNK_TOKENS = 1024
"""Response tokens whose logits :func:`token_scores` holds at once (``chunk_tokens``'s default).

Scoring memory is then ``chunk × V`` floats, not ``tokens × V``: at V = 151,936 one float32 ``[1024, V]`` tensor
is 0.62 GB and a chunk's forward (or its recomputation in the backward) holds a few of them (logits, log-probs,
their exp), where 32 × 1,024 tokens at once would take 20 GB per tensor. 1,024 rows keep the LM-head matmul
``[chunk, H] × [H, V]`` as efficient as a larger one on a GPU; lower it when even a few ``[chunk, V]`` tensors are
too many (``TorchTrainConfig.scoring_chunk_tokens``)."""


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
            suppressed ids; policy models, when asked for).
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
        packed: bool = False,
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
        if length > 1 and packed:
            rest = _packed_response_states(
                thinker,
                thinker.get_input_embeddings(),
                decoder,
                prefix.past_key_values,
                (prompt_mask, next_pos.to(device), row_prompt),
                clean,
            )
            hidden = torch.cat([hidden, rest], dim=1)  # [B, L, H]
        elif length > 1:  # response tokens 0 .. L-2, on each row's copy of its prompt's cache, predict 1 .. L-1
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


PACKING_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take the packed forward's ``[1, 1, N, U·P + N]`` mask (a dense 4-D mask: varlen
kernels such as flash-attention take ``cu_seqlens`` of one contiguous key run per sequence, which a row continuing a
prompt cached once for its whole group does not have)."""


def check_packing(model: torch.nn.Module) -> None:
    """Raises ValueError unless ``model``'s text decoder runs an attention in :data:`PACKING_ATTENTION`."""
    attention = _attention_of(model)
    if attention not in PACKING_ATTENTION:
        raise ValueError(
            f"trainer.packing needs the decoder's attention to be one of {PACKING_ATTENTION}, got {attention!r}"
        )


def _attention_of(model: torch.nn.Module) -> object:
    """The attention implementation transformers runs in ``model``'s text decoder."""
    return getattr(text_decoder(model).config, "_attn_implementation", None)


def _packed_response_states(
    thinker: torch.nn.Module,
    embed: torch.nn.Module,
    decoder: torch.nn.Module,
    prefix_cache: DynamicCache,
    prompts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    responses: Sequence[torch.Tensor],
) -> torch.Tensor:
    """States of response tokens ``0 .. l_b-2`` of every row (predicting ``1 .. l_b-1``), run as one packed row.

    The ``N = Σ_b (l_b − 1)`` response tokens of the ``B`` rows form one sequence after the ``U × P`` cached keys of
    the distinct prompts (laid end to end, each prompt once); a block mask lets a token see its own prompt's real
    keys and its own row's earlier tokens, at the positions a padded row gives it. Each token's attention then
    has the keys and positions of the padded forward and no other (the others' weights are exactly 0), so the
    states are the padded forward's to float rounding, without running a single padding position.

    Args:
        thinker: The model (its family's positions and attention).
        embed: Its input embeddings.
        decoder: Its text decoder.
        prefix_cache: The distinct prompts' cache, ``[U, h, P, d]`` per layer.
        prompts: ``(mask [U, P] of the left-padded prompts, next position [U], prompt of each row [B])``.
        responses: ``B`` response ids ``[l_b]`` (suppressed ids already replaced by padding).

    Returns:
        ``[B, L-1, H]`` states (zero past each row's length), ``L`` the longest response.
    """
    prompt_mask, next_pos, row_prompt = prompts
    device = prompt_mask.device
    lengths = torch.tensor([len(r) - 1 for r in responses])  # [B] tokens fed per row
    longest = int(lengths.max())
    row_of = torch.repeat_interleave(torch.arange(len(responses)), lengths).to(device)  # [N]
    step_of = torch.cat([torch.arange(int(n)) for n in lengths]).to(device)  # [N]
    slot_of = row_prompt[row_of]  # [N] each token's prompt
    feed = torch.cat([r[:-1] for r in responses]).to(device)  # [N]
    u, p = prompt_mask.shape
    key_slot = torch.arange(u, device=device).repeat_interleave(p)  # [U·P] prompt of each cached key
    sees_prompt = (slot_of[:, None] == key_slot[None]) & prompt_mask.reshape(-1).bool()[None]  # [N, U·P]
    sees_own = (row_of[:, None] == row_of[None]) & (step_of[None] <= step_of[:, None])  # [N, N]
    allowed = torch.cat([sees_prompt, sees_own], dim=1)[None, None]  # [1, 1, N, U·P + N]
    embeds = embed(feed)[None]  # [1, N, H]
    if _attention_of(thinker) == "eager":  # eager adds the mask to its scores
        mask = torch.zeros(allowed.shape, dtype=embeds.dtype, device=device)
        mask = mask.masked_fill(~allowed, torch.finfo(embeds.dtype).min)
    else:
        mask = allowed
    out = decoder(
        inputs_embeds=embeds,
        attention_mask=mask,
        position_ids=position_ids_for(thinker, (next_pos[slot_of] + step_of).expand(3, 1, -1)),  # [3, 1, N]
        past_key_values=_prompts_end_to_end(prefix_cache),
        use_cache=True,
    )
    hidden: torch.Tensor = out.last_hidden_state[0]  # [N, H]
    states = hidden.new_zeros((len(responses), longest, hidden.shape[-1]))  # [B, L-1, H]
    return states.index_put((row_of, step_of), hidden)


def _prompts_end_to_end(cache: DynamicCache) -> DynamicCache:
    """The prompt cache of ``U`` rows as one row: every layer's ``[U, h, P, d]`` keys and values as
    ``[1, h, U·P, d]`` (prompt-major, the order of the packed mask's key columns)."""
    layers = []
    for keys, values, sliding in cache:
        if sliding is not None:
            raise ValueError("trainer.packing does not support sliding-window attention layers")
        u, h, p, d = keys.shape
        layers.append(
            (
                keys.transpose(0, 1).reshape(h, u * p, d)[None],  # [1, h, U·P, d]
                values.transpose(0, 1).reshape(h, u * p, values.shape[-1])[None],
            )
        )
    return DynamicCache(ddp_cache_data=layers)


def score_responses(
    model: torch.nn.Module,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    temperature: float = 1.0,
    suppressed_ids: Sequence[int] = (),
    device: torch.device | str = "cpu",
    *,
    with_dist: bool = False,
    chunk_tokens: int = SCORING_CHUNK_TOKENS,
    packed: bool = False,
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
        with_dist: Also return the whole ``[B, L, V]`` log-distributions (``dist``); the log-probs and entropy are
            then read from them. Without it they are computed ``chunk_tokens`` tokens at a time
            (:func:`token_scores`) and no ``[B, L, V]`` tensor exists.
        chunk_tokens: Tokens per LM-head chunk without ``with_dist``.
        packed: Run the responses packed into one row instead of right-padded (:func:`check_packing`); the same
            scores to float rounding.

    Returns:
        Scores with grad if grad is enabled.
    """
    states = _ResponseStates.compute(model, prompts, responses, suppressed_ids, device, packed)
    valid = states.valid
    lm_head: torch.nn.Module = model.lm_head  # type: ignore[assignment]
    if not with_dist:
        token_logp, entropy = token_scores(
            lm_head, states.hidden, states.targets, valid, temperature, suppressed_ids, chunk_tokens
        )
        return TokenScores(logprobs=token_logp, entropy=entropy, mask=valid.float())
    logp_all = policy_logprobs(lm_head(states.hidden), temperature, suppressed_ids)  # [B, L, V]
    token_logp, entropy = _pick_and_entropy(logp_all, states.targets)  # [B, L] each
    zero = torch.zeros((), device=device)
    return TokenScores(
        logprobs=torch.where(valid, token_logp, zero),
        entropy=torch.where(valid, entropy, zero),
        mask=valid.float(),
        dist=logp_all,
    )


def token_scores(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    temperature: float = 1.0,
    suppressed_ids: Sequence[int] = (),
    chunk_tokens: int = SCORING_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and entropy of each position under
    :func:`~relax_services.engines.sampling.policy_logprobs` of ``lm_head(hidden)``, without the
    ``[B, L, V]`` logits.

    The valid positions are flattened and run through the LM head ``chunk_tokens`` at a time; each chunk keeps
    only its ``[chunk]`` results. With grad, a chunk's ``[chunk, V]`` activations are not saved for the backward
    but recomputed there (activation checkpointing per chunk), so the peak is one chunk's whatever the number
    of tokens. The values are those of the dense formula on each row (the same functions on fewer rows).

    Args:
        lm_head: Maps ``[..., H]`` states to ``[..., V]`` logits.
        hidden: ``[B, L, H]`` states; position ``(b, j)`` predicts ``targets[b, j]``.
        targets: ``[B, L]`` token ids.
        valid: ``[B, L]`` bool, the positions to score.
        temperature: Sampling temperature (0 means 1).
        suppressed_ids: Ids outside the support.
        chunk_tokens: Positions per LM-head call (>= 1).

    Returns:
        ``(logprobs [B, L], entropy [B, L])`` in :func:`~relax_services.engines.sampling.policy_logprobs`' dtype
        (float32, or float64 for a float64 head), 0 where not ``valid``.

    Raises:
        ValueError: If ``chunk_tokens`` < 1.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    flat_hidden = hidden[valid]  # [N, H], row-major like masked_scatter below
    flat_targets = targets[valid]  # [N]
    n = flat_targets.shape[0]
    # With grad, recompute each chunk in the backward instead of saving its [chunk, V] activations; the chunk
    # draws no random numbers, so there is no RNG state to replay.
    recompute = torch.is_grad_enabled()

    def score(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp_all = policy_logprobs(lm_head(x), temperature, suppressed_ids)  # [chunk, V]
        return _pick_and_entropy(logp_all, t)

    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for start in range(0, max(n, 1), chunk_tokens):  # one empty chunk when n == 0 keeps the graph connected
        tick()
        x, t = flat_hidden[start : start + chunk_tokens], flat_targets[start : start + chunk_tokens]
        if recompute:
            out = checkpoint(score, x, t, use_reentrant=False, preserve_rng_state=False)
            parts.append((out[0], out[1]))
        else:
            parts.append(score(x, t))
    flat_logp, flat_entropy = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])  # [N]
    zeros = flat_logp.new_zeros(valid.shape)  # [B, L]
    return zeros.masked_scatter(valid, flat_logp), zeros.masked_scatter(valid, flat_entropy)


def _pick_and_entropy(logp_all: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-prob of each target [...], entropy [...])`` from ``[..., V]`` log-probs (``-inf`` off the support,
    which adds 0 to the entropy rather than 0 · ∞)."""
    token_logp = logp_all.gather(-1, targets[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
    return token_logp, entropy


def score_values(
    model: ValueModel,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    suppressed_ids: Sequence[int] = (),
    device: torch.device | str = "cpu",
    *,
    packed: bool = False,
) -> TokenScores:
    """Critic values at each response position: ``values[b, j]`` is ``V`` of the state before response token
    ``j`` (the column whose policy logits predict it). Masking and ``packed`` are :func:`score_responses`'.

    Returns:
        Scores with ``values`` set (with grad if grad is enabled); ``logprobs`` and ``entropy`` are zero.
    """
    states = _ResponseStates.compute(model.thinker, prompts, responses, suppressed_ids, device, packed)
    values = model.value_head(states.hidden)[..., 0]  # [B, L]
    valid = states.valid
    zeros = torch.zeros(valid.shape, device=device)
    return TokenScores(logprobs=zeros, entropy=zeros, mask=valid.float(), values=torch.where(valid, values, 0.0))
