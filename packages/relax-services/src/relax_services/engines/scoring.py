"""Per-token log-probs, entropy and values of responses under a model.

A GRPO batch holds each prompt once per completion, and prompts are far longer than the answers. So each
distinct prompt is run once (its media encoded once), its key/value cache is shared by the rows that
continue it, and only the response tokens run per row: the same numbers as one padded forward of every
``prompt + response`` row (to float rounding), at a fraction of the cost. Gradients of the rows add up in
the shared prompt computation, which is the gradient of the row-by-row forward.

The LM head runs over the response states a chunk of tokens at a time (:func:`token_scores`): a real
vocabulary makes the ``[B, L, V]`` logits of a batch tens of GB, and only the target token's log-prob and the
entropy leave each chunk. The exact full-vocabulary KL to a frozen reference policy
(``algorithm.kl_estimator='full'``) is computed the same way (:func:`token_scores_with_kl`): the reference's response
states are computed once without grad, and each chunk builds both ``[chunk, V]`` distributions and keeps the
per-token KL; no ``[B, L, V]`` tensor exists on any path.

A multi-turn episode whose environment returned media after the first turn carries them in its prompt
(:meth:`~relax_services.agents.Episode.sample_prompt`: the prompt's media, then the response's, in conversation
order) and their placeholders in its response. Such rows run as one padded forward of their whole conversations
(media in their placeholders, the multimodal rope positions of each whole sequence: what the rollout engine's
prefill of each later turn computed), not as a shared prompt and a text continuation.

Used by the training engine (with grad) and by anything that rescores samples (reference model,
proximal log-probs, critic values) without grad.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from relax_core import kl_full
from relax_services.engines.progress import tick
from relax_services.engines.sampling import policy_logprobs
from relax_services.models.deepstack import text_decoder
from relax_services.models.embeddings import decoder_inputs
from relax_services.models.inputs import OmniPrompt, audio_token_count, collate_media, pad_sequences
from relax_services.models.modalities import MODEL_MODALITIES, AudioModality, VisionModality
from relax_services.models.positions import position_ids_for, rope_positions, sequence_positions
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
        full_kl: ``[B, L]`` exact KL(π_ref ‖ π) over the vocabulary at each response position, unclamped (0 where
            masked; policy models scored against a :class:`FrozenReference`).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor | None = None
    full_kl: torch.Tensor | None = None


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


class ReplayableCache(DynamicCache):
    """A key/value cache a forward may run through twice with the same result, as activation checkpointing runs it
    (each checkpointed decoder block's forward runs again in the backward pass and calls :meth:`update` again).

    A growing cache would append the same keys a second time. Instead there are two uses, one object each:

    - The prompts' forward (the cache starts empty): a layer keeps its first update's keys and values. An update of
      a layer that already holds them is that forward's recompute, which began on an empty cache too, so it
      returns the new keys and values alone and stores nothing.
    - :meth:`continuation`, what the forward after the prompts reads: every update returns the prompts' keys and
      values followed by the new ones (what a growing cache returns) and stores nothing; nothing reads a
      response's keys after its own forward.
    """

    read_only = False
    """Set on a :meth:`continuation`: updates return the held keys and the new ones, and store nothing."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values layer ``layer_idx`` attends to (see the class)."""
        layer: Any = self.layers[layer_idx] if layer_idx < len(self.layers) else None  # an attention layer's
        if self.read_only:
            return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)
        if layer is not None and layer.is_initialized:
            return key_states, value_states  # the recompute of a forward that began on an empty cache
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return keys, values

    def continuation(self, rows: torch.Tensor | None = None) -> ReplayableCache:
        """A read-only view of what this cache holds (``rows``: row ``b`` continues held row ``rows[b]``); this
        cache is left as it is (its recompute still finds every layer written)."""
        out = copy.copy(self)
        out.layers = [copy.copy(layer) for layer in self.layers]
        out.read_only = True
        if rows is not None:
            out.batch_select_indices(rows)
        return out


def prompt_cache(decoder: torch.nn.Module) -> ReplayableCache:
    """An empty :class:`ReplayableCache` for the prompts' forward of ``decoder`` (a transformers text decoder:
    its config gives the layers' kinds)."""
    return ReplayableCache(config=cast(Any, decoder).config)


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
        # Suppressed ids (media placeholders and markers among them) in a response are never scored. They are fed as
        # they are: an environment's turn of a multi-turn episode holds the template's special tokens (and the
        # placeholders of its media), which the rollout saw; the text path embeds a response's ids as text, so a
        # stray placeholder there is never taken for media.
        pad_id = model_pad_id(thinker)
        banned = torch.tensor(sorted(suppressed_ids), dtype=torch.long)
        raw = [r.long().cpu() for r in responses]
        kept = [~torch.isin(r, banned) for r in raw]
        clean = [torch.where(k, r, pad_id) for r, k in zip(raw, kept, strict=True)]
        targets, response_mask = pad_sequences(clean, pad_id, side="right")  # [B, L]
        kept_padded, _ = pad_sequences([k.long() for k in kept], 0, side="right")  # [B, L]
        targets, response_mask = targets.to(device), response_mask.to(device)
        valid = kept_padded.to(device).bool() & response_mask.bool()
        length = targets.shape[1]
        decoder = text_decoder(thinker)  # final hidden states, no LM head

        whole = [_has_response_media(thinker, p) for p in prompts]
        if not any(whole):
            hidden = _prompt_and_text_states(thinker, decoder, prompts, raw, response_mask, pad_id, device, packed)
            return cls(hidden[:, :length], targets, valid)
        rows: list[torch.Tensor | None] = [None] * len(prompts)
        text_rows = [i for i, w in enumerate(whole) if not w]
        if text_rows:
            sub_mask = pad_sequences([raw[i] for i in text_rows], pad_id, side="right")[1].to(device)
            states = _prompt_and_text_states(
                thinker,
                decoder,
                [prompts[i] for i in text_rows],
                [raw[i] for i in text_rows],
                sub_mask,
                pad_id,
                device,
                packed,
            )
            for j, i in enumerate(text_rows):
                rows[i] = states[j, : len(raw[i])]
        conversations = [i for i, w in enumerate(whole) if w]
        states_of = _conversation_states(
            thinker, decoder, [prompts[i] for i in conversations], [raw[i] for i in conversations], pad_id, device
        )
        for i, states in zip(conversations, states_of, strict=True):
            rows[i] = states
        padded = [torch.nn.functional.pad(r, (0, 0, 0, length - r.shape[0])) for r in rows if r is not None]
        return cls(torch.stack(padded), targets, valid)  # [B, L, H]


def _placeholder_count(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Media placeholder tokens of the built-in modalities in ``ids``."""
    tokens = [getattr(model.config, m.token_attr, None) for m in MODEL_MODALITIES.values()]
    return sum(int((ids == t).sum()) for t in tokens if t is not None)


def _media_token_count(model: torch.nn.Module, prompt: OmniPrompt) -> int:
    """Placeholder tokens the prompt's media fill: a vision item's merged patches (``t·h·w / merge²``), an audio
    clip's encoder length; 0 for a modality outside the built-in ones (whose rows then score as text)."""
    merge = int(getattr(getattr(model.config, "vision_config", None), "spatial_merge_size", 1) or 1)
    total = 0
    for modality in MODEL_MODALITIES.values():
        media = prompt.media_of(modality)
        if isinstance(modality, VisionModality) and modality.grid in media:
            total += int(media[modality.grid].prod(-1).sum()) // (merge * merge)
        elif isinstance(modality, AudioModality) and "feature_attention_mask" in media:
            total += sum(audio_token_count(int(n)) for n in media["feature_attention_mask"].sum(-1))
    return total


def _has_response_media(model: torch.nn.Module, prompt: OmniPrompt) -> bool:
    """Whether ``prompt`` carries more media than its own placeholders take: the rest fill its response's (a
    multi-turn episode's sample, :meth:`~relax_services.agents.Episode.sample_prompt`)."""
    return bool(prompt.media()) and _media_token_count(model, prompt) > _placeholder_count(model, prompt.input_ids)


def _conversation_states(
    thinker: torch.nn.Module,
    decoder: torch.nn.Module,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    pad_id: int,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """``[l_b, H]`` states predicting each response token of each row, from one right-padded forward of every
    ``prompt + response`` with every media item in its placeholders and the rope positions of each whole sequence
    (the family's own rule over it; padding after a row changes none of its states under the causal mask)."""
    wholes = [
        OmniPrompt(torch.cat([p.input_ids, r]), **p.media()) for p, r in zip(prompts, responses, strict=True)
    ]  # [P_b + l_b] each
    ids, mask = pad_sequences([w.input_ids for w in wholes], pad_id, side="right")  # [B, T]
    positions = rope_positions(thinker, ids, mask, collate_media(wholes))  # [3, B, T]
    ids, mask = ids.to(device), mask.to(device)
    out = decoder(
        **decoder_inputs(thinker, wholes, ids, device),
        attention_mask=mask,
        position_ids=position_ids_for(thinker, positions.to(device)),
        use_cache=False,
    )
    hidden: torch.Tensor = out.last_hidden_state  # [B, T, H]
    starts = [p.num_tokens - 1 for p in prompts]
    return [hidden[b, start : start + len(r)] for b, (start, r) in enumerate(zip(starts, responses, strict=True))]


def _prompt_and_text_states(
    thinker: torch.nn.Module,
    decoder: torch.nn.Module,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    response_mask: torch.Tensor,
    pad_id: int,
    device: torch.device | str,
    packed: bool,
) -> torch.Tensor:
    """``[B, L, H]`` states predicting each response token (``L`` the longest response): each distinct prompt run
    once, its cache shared by the rows that continue it, the responses as text after it."""
    targets, _ = pad_sequences(list(responses), pad_id, side="right")  # [B, L]
    targets = targets.to(device)
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
        past_key_values=prompt_cache(decoder),
        use_cache=True,
    )
    hidden: torch.Tensor = prefix.last_hidden_state[row_prompt, -1:]  # [B, 1, H]: predicts response token 0
    length = targets.shape[1]
    embed = cast(Any, thinker).get_input_embeddings()  # a transformers model: typed loosely
    if length > 1 and packed:
        rest = _packed_response_states(
            thinker,
            embed,
            decoder,
            prefix.past_key_values,
            (prompt_mask, next_pos.to(device), row_prompt),
            responses,
        )
        hidden = torch.cat([hidden, rest], dim=1)  # [B, L, H]
    elif length > 1:  # response tokens 0 .. L-2, on each row's copy of its prompt's cache, predict 1 .. L-1
        cache = prefix.past_key_values.continuation(row_prompt)
        steps = torch.arange(length - 1, device=device)
        chunk = decoder(
            inputs_embeds=embed(targets[:, :-1]),
            attention_mask=torch.cat([prompt_mask[row_prompt], response_mask[:, :-1]], dim=1),
            position_ids=position_ids_for(thinker, (next_pos.to(device)[row_prompt, None] + steps).expand(3, -1, -1)),
            past_key_values=cache,
            use_cache=True,
        )
        hidden = torch.cat([hidden, chunk.last_hidden_state], dim=1)  # [B, L, H]
    return hidden


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
        responses: ``B`` response ids ``[l_b]``.

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


def _prompts_end_to_end(cache: DynamicCache) -> ReplayableCache:
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
    return ReplayableCache(ddp_cache_data=layers).continuation()


class FrozenReference:
    """The frozen reference policy of the exact full-vocabulary KL, held by a training engine beside its policy.

    Not a ``torch.nn.Module`` on purpose: as an attribute of the engine's model (or of an FSDP root) a module
    would be registered as a submodule, and then trained, sharded and saved with the policy.

    Args:
        model: The initial checkpoint's policy (the weights the Reference service scores with); moved to
            ``device`` in ``dtype``, put in eval mode and frozen (no parameter requires grad).
        device: The engine's device.
        dtype: The reference's weight dtype (``dtype_of(cfg, "reference")``: the Reference service's); None keeps
            the model's own.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
        self.model = model.to(device, dtype).eval().requires_grad_(False)

    @property
    def lm_head(self) -> torch.nn.Module:
        """The reference's LM head (``[..., H] → [..., V]`` logits)."""
        head: torch.nn.Module = self.model.lm_head  # type: ignore[assignment]
        return head

    def hidden(
        self,
        prompts: Sequence[OmniPrompt],
        responses: Sequence[torch.Tensor],
        suppressed_ids: Sequence[int],
        device: torch.device | str,
    ) -> torch.Tensor:
        """``[B, L, H]`` final states of the reference at the response positions (:class:`_ResponseStates`), without
        grad: position ``(b, j)`` predicts response token ``j`` of row ``b``."""
        with torch.no_grad():
            return _ResponseStates.compute(self.model, prompts, responses, suppressed_ids, device).hidden


def score_responses(
    model: torch.nn.Module,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    temperature: float = 1.0,
    suppressed_ids: Sequence[int] = (),
    device: torch.device | str = "cpu",
    *,
    reference: FrozenReference | None = None,
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
        reference: With a frozen reference policy, also the exact per-token KL(π_ref ‖ π) over the vocabulary
            (``full_kl``, :func:`token_scores_with_kl`); the reference's states are computed without grad.
        chunk_tokens: Tokens per LM-head chunk (:func:`token_scores`); no ``[B, L, V]`` tensor exists.
        packed: Run the responses packed into one row instead of right-padded (:func:`check_packing`); the same
            scores to float rounding.

    Returns:
        Scores with grad if grad is enabled.
    """
    states = _ResponseStates.compute(model, prompts, responses, suppressed_ids, device, packed)
    valid = states.valid
    lm_head: torch.nn.Module = model.lm_head  # type: ignore[assignment]
    if reference is None:
        token_logp, entropy = token_scores(
            lm_head, states.hidden, states.targets, valid, temperature, suppressed_ids, chunk_tokens
        )
        return TokenScores(logprobs=token_logp, entropy=entropy, mask=valid.float())
    ref_hidden = reference.hidden(prompts, responses, suppressed_ids, device)  # [B, L, H], no grad
    token_logp, entropy, kl = token_scores_with_kl(
        lm_head,
        states.hidden,
        reference.lm_head,
        ref_hidden,
        states.targets,
        valid,
        temperature,
        suppressed_ids,
        chunk_tokens,
    )
    return TokenScores(logprobs=token_logp, entropy=entropy, mask=valid.float(), full_kl=kl)


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

    def score(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logp_all = policy_logprobs(lm_head(x), temperature, suppressed_ids)  # [chunk, V]
        return _pick_and_entropy(logp_all, t)

    token_logp, entropy = _chunked(score, (hidden, targets), valid, chunk_tokens)
    return token_logp, entropy


def token_scores_with_kl(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    ref_head: torch.nn.Module,
    ref_hidden: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    temperature: float = 1.0,
    suppressed_ids: Sequence[int] = (),
    chunk_tokens: int = SCORING_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`token_scores` and the exact KL(π_ref ‖ π) over the vocabulary at each position, a chunk at a time.

    Each chunk of ``chunk_tokens`` valid positions builds the policy's ``[chunk, V]`` log-probs from ``hidden`` and
    the reference's from ``ref_hidden`` (both :func:`~relax_services.engines.sampling.policy_logprobs`: the same
    temperature and support) and keeps relax-core's :func:`~relax_core.kl_full` of them, unclamped (the loss
    clamps it with ``algorithm.kl_clamp``): the same formula, direction and handling of ids off the reference's
    support, on fewer rows. With grad the chunk is recomputed in the backward, as in :func:`token_scores`, so
    memory is a few ``[chunk, V]`` tensors whatever the number of tokens. The reference side carries no gradient.

    Args:
        lm_head: The policy's LM head.
        hidden: ``[B, L, H]`` policy states; position ``(b, j)`` predicts ``targets[b, j]``.
        ref_head: The reference's LM head (frozen).
        ref_hidden: ``[B, L, H']`` reference states at the same positions (no grad).
        targets, valid, temperature, suppressed_ids, chunk_tokens: As in :func:`token_scores`.

    Returns:
        ``(logprobs [B, L], entropy [B, L], full_kl [B, L])``, 0 where not ``valid``; ``full_kl`` is
        differentiable w.r.t. ``hidden`` and the policy's head.

    Raises:
        ValueError: If ``chunk_tokens`` < 1.
    """

    def score(x: torch.Tensor, t: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logp_all = policy_logprobs(lm_head(x), temperature, suppressed_ids)  # [chunk, V]
        with torch.no_grad():
            ref_all = policy_logprobs(ref_head(r), temperature, suppressed_ids)  # [chunk, V]
        kl = kl_full(logp_all[None], ref_all[None].to(logp_all.dtype), clamp=None)[0]  # [chunk]
        return (*_pick_and_entropy(logp_all, t), kl)

    token_logp, entropy, kl = _chunked(score, (hidden, targets, ref_hidden.detach()), valid, chunk_tokens)
    return token_logp, entropy, kl


def _chunked(
    score: Callable[..., tuple[torch.Tensor, ...]],
    per_position: tuple[torch.Tensor, ...],
    valid: torch.Tensor,
    chunk_tokens: int,
) -> list[torch.Tensor]:
    """``score`` over the valid positions, ``chunk_tokens`` at a time, its ``[chunk]`` outputs scattered back to
    ``[B, L]`` (0 where not ``valid``).

    ``per_position`` holds ``[B, L, ...]`` tensors; ``score`` takes their ``[chunk, ...]`` rows and returns
    ``[chunk]`` tensors. With grad, each chunk's activations are not saved for the backward but recomputed there
    (activation checkpointing per chunk); the chunk draws no random numbers, so there is no RNG state to replay.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    flat = [x[valid] for x in per_position]  # [N, ...] each, row-major like masked_scatter below
    n = flat[0].shape[0]
    recompute = torch.is_grad_enabled()

    def ticking(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tick()  # in the forward and again in the backward's recomputation (CPU autograd runs on this thread)
        return score(*args)

    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, max(n, 1), chunk_tokens):  # one empty chunk when n == 0 keeps the graph connected
        args = [x[start : start + chunk_tokens] for x in flat]
        if recompute:
            parts.append(tuple(checkpoint(ticking, *args, use_reentrant=False, preserve_rng_state=False)))
        else:
            parts.append(ticking(*args))
    outputs = [torch.cat(column) for column in zip(*parts, strict=True)]  # [N] each
    zeros = outputs[0].new_zeros(valid.shape)  # [B, L]
    return [zeros.masked_scatter(valid, out) for out in outputs]


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
