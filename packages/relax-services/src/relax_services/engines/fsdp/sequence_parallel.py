"""Sequence parallelism of the text decoder (Ulysses, Jacobs et al. 2023, arXiv:2309.14509): every rank of an sp
group holds a contiguous ``1/sp`` slice of each sequence for every op outside attention (embeddings in, MLPs,
norms, LM head, loss scoring); around attention an all-to-all turns "my tokens, all heads" into "all tokens,
``heads/sp`` heads", attention runs over the whole sequence, and a second all-to-all turns it back.

Why Ulysses and not ring attention: relax's scoring runs the families' own attention (transformers' SDPA) with
arbitrary 4-D masks (left-padded prompts, one prompt cache shared by a group's rows), and Ulysses leaves that kernel
and its mask untouched (it only changes which heads a rank computes), where ring attention would re-implement a
blockwise online-softmax attention for every mask shape. Its limit: ``sp`` must divide the attention heads (per
tensor-parallel rank); key/value heads it does not divide (GQA models have 2 to 8) are exchanged expanded, one copy
per query head.

How a micro-batch is split (:func:`score_responses_sp`): the distinct prompts ``[U, P]`` are left-padded to a
multiple of ``sp`` and rank ``r`` runs columns ``[r·P/sp, (r+1)·P/sp)`` through the decoder (each rank keeps its
slice of the key/value cache); the responses' input tokens ``[B, L−1]`` are right-padded to a multiple of ``sp`` and
split the same way, attending to the whole prompt cache. Rope positions are computed for the whole sequence and
sliced with it, so every token keeps its exact position. The masks are built for the whole sequence
(:func:`prompt_mask_4d`, :func:`response_mask_4d`; none for a prompt without padding, whose attention is causal
and runs in SDPA's fused kernel): attention sees the whole sequence after the exchange. Each
rank runs the LM head on its own slice only, so the ``[L, V]`` logits are split as well; the per-token log-probs,
entropies (and values, full KL) of the slices are then all-gathered into the whole ``[B, L]`` rows, so the loss
function sees exactly the rows one process sees and computes the same loss and units on every rank of the sp group.
The gather's backward hands each rank the gradient of its own slice (not a sum over ranks: every rank computes the
same loss), and FSDP2 sums the parameter gradients over ``dp × sp`` (each rank's are those of its slice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx
from torch.distributed.device_mesh import DeviceMesh

from relax_services.engines.scoring import (
    FrozenReference,
    TokenScores,
    distinct_prompts,
    prompt_cache,
    token_scores,
    token_scores_with_kl,
)
from relax_services.models.deepstack import text_decoder
from relax_services.models.embeddings import MediaEncoder, decoder_inputs, encode_media
from relax_services.models.inputs import OmniPrompt, pad_sequences
from relax_services.models.modalities import ModelModality, VisionModality
from relax_services.models.positions import position_ids_for, sequence_positions
from relax_services.models.tokens import model_pad_id
from relax_services.models.value import ValueModel

__all__ = [
    "ULYSSES_ATTENTION",
    "SequenceParallel",
    "check_sequence_parallel",
    "enable_sequence_parallel",
    "prompt_mask_4d",
    "response_mask_4d",
    "score_responses_sp",
    "score_values_sp",
    "time_shares",
]

ULYSSES_ATTENTION = "relax_ulysses"
"""The attention implementation name a sequence-parallel engine gives its text decoder: SDPA, with the Ulysses
exchange around it when the forward is called with a ``sequence_parallel`` argument (plain SDPA otherwise)."""


@dataclass
class SequenceParallel:
    """A sequence-parallel group: its process group, this rank's place in it, and what it has exchanged.

    Attributes:
        group: The sp process group (the mesh's ``cp`` dimension).
        rank: This rank in ``group``.
        size: Ranks in ``group``.
        exchanges: All-to-all calls run in forwards so far (four per attention layer call, five when keys and
            values include a cached prefix: the cache and the new tokens are exchanged separately).
        local_tokens: Input positions this rank ran through the decoder so far (its slices, padding included).
        encoded_items: Prompts whose media (of one modality) this rank encoded so far (its share of each
            micro-batch's distinct ones); videos are split along time instead and counted in ``encoded_frames``.
        encoded_frames: Temporal patches of videos this rank encoded so far (its share of each micro-batch's).
    """

    group: dist.ProcessGroup
    rank: int
    size: int
    exchanges: int = 0
    local_tokens: int = 0
    encoded_items: int = 0
    encoded_frames: int = 0

    @classmethod
    def of(cls, mesh: DeviceMesh) -> SequenceParallel:
        """The group of a 1-D mesh."""
        if mesh.ndim != 1:
            raise ValueError(f"the sequence-parallel mesh must be 1-D, got {mesh.ndim} dimensions")
        return cls(group=mesh.get_group(), rank=mesh.get_local_rank(), size=mesh.size())

    def all_to_all(self, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """``x`` cut into ``size`` chunks along ``scatter_dim``, chunk ``i`` sent to rank ``i``, the received chunks
        concatenated along ``gather_dim`` in rank order (differentiable: the backward is the reverse exchange)."""
        self.exchanges += 1
        out: torch.Tensor = _AllToAll.apply(x, scatter_dim, gather_dim, self.group, self.size)
        return out

    def slice_of(self, length: int) -> slice:
        """This rank's contiguous slice of ``length`` positions (a multiple of ``size``)."""
        if length % self.size:
            raise ValueError(f"a sequence of {length} positions does not split over sp={self.size} ranks")
        n = length // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def gather_slices(self, local: torch.Tensor) -> torch.Tensor:
        """``[size, *local.shape]``: every rank's ``local`` in rank order (collective). The backward hands this rank
        the gradient of its own entry only: every rank computes the same loss from the gathered rows."""
        out: torch.Tensor = _GatherSlices.apply(local, self.group, self.rank, self.size)
        return out

    def share_encoding(self) -> MediaEncoder:
        """:func:`~relax_services.models.embeddings.encode_media` with the work shared: of a modality's ``n``
        distinct prompts, rank ``r`` encodes the contiguous ``r``-th of ``sp`` shares (``ceil(n / sp)`` each) and the
        features are all-gathered, so every rank has them all (each needs the ones in its sequence slices). The
        gather's backward sums the ranks' gradients of each feature and hands each rank those of its own share:
        its encoder's gradient is that of its items under the whole loss, and FSDP sums the encoders' over ranks.
        """

        def encode(
            model: object, modality: ModelModality, prompts: Sequence[OmniPrompt], device: torch.device, deepstack: bool
        ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
            if deepstack:
                raise ValueError(
                    "sequence parallelism does not split DeepStack vision features: use sequence_parallel=1"
                )
            if isinstance(modality, VisionModality) and modality.seconds is not None:
                return self._encode_along_time(model, modality, prompts, device), []
            per = -(-len(prompts) // self.size)
            mine = prompts[self.rank * per : (self.rank + 1) * per]
            self.encoded_items += len(mine)
            own = encode_media(model, modality, mine, device, deepstack)[0] if mine else []
            return self._exchange_features(own, per, device), []

        return encode

    def _encode_along_time(
        self, model: object, video: VisionModality, prompts: Sequence[OmniPrompt], device: torch.device
    ) -> list[torch.Tensor]:
        """Each prompt's video features ``[tokens_i, H]``, the work split along time: the micro-batch's temporal
        patches (every video's ``t`` of its ``(t, h, w)`` grid, in prompt, item and time order) are cut into ``size``
        contiguous shares of about equal patch counts (:func:`time_shares`), rank ``r`` encodes the ``r``-th (as
        pieces of ``(t', h, w)``, a video's consecutive frames in it) and the pieces' features are all-gathered in
        order. Exact for the families' vision towers: they attend within a temporal patch (window and full attention
        alike, ``cu_seqlens`` per frame) with 2-D rotary positions, so a piece's features are the whole video's
        rows for those frames."""
        parts = [p.media_of(video) for p in prompts]
        frames = [
            (i, row, k, int(h) * int(w))
            for i, part in enumerate(parts)
            for row, (t, h, w) in enumerate(part[video.grid].tolist() if part else [])
            for k in range(int(t))
        ]
        shares = time_shares([patches for *_, patches in frames], self.size)
        pieces = _pieces(
            frames, shares, self.size
        )  # per rank: (prompt, grid row, first frame, frames, patches per frame)
        mine = pieces[self.rank]
        own: list[torch.Tensor] = []
        if mine:
            pixels, grids = [], []
            for i, row, first, count, area in mine:
                grid = parts[i][video.grid]
                start = int(grid[:row].prod(-1).sum()) + first * area
                pixels.append(parts[i][video.pixels][start : start + count * area])
                grids.append(torch.tensor([count, int(grid[row, 1]), int(grid[row, 2])]))
            media = {video.pixels: torch.cat(pixels).to(device), video.grid: torch.stack(grids).to(device)}
            own = list(video.encode(model, media))
            self.encoded_frames += sum(count for _, _, _, count, _ in mine)
        gathered = self._exchange_features(own, max(len(p) for p in pieces), device)
        per_prompt: list[list[torch.Tensor]] = [[] for _ in prompts]
        for (i, *_), features in zip((q for share in pieces for q in share), gathered, strict=True):
            per_prompt[i].append(features)
        return [torch.cat(f) for f in per_prompt]

    def _exchange_features(self, own: list[torch.Tensor], per: int, device: torch.device) -> list[torch.Tensor]:
        """Every rank's ``own`` features (``[tokens_i, H]`` each, up to ``per`` of them), in rank order."""
        sizes = torch.tensor([f.shape[0] for f in own] + [-1] * (per - len(own)), device=device)  # -1: no item
        every = [torch.empty_like(sizes) for _ in range(self.size)]
        dist.all_gather(every, sizes, group=self.group)
        counts = torch.stack(every).cpu()  # [sp, per]
        rows = int(counts.clamp(min=0).sum(1).max())
        width = next((f.shape[1] for f in own), None)
        width = int(self._max(torch.tensor([width or 0], device=device)))
        local = torch.zeros((rows, width), dtype=torch.float32, device=device)  # [rows, H] padded
        if own:
            flat = torch.cat(own).float()
            local = torch.cat([flat, local[flat.shape[0] :]])
        if torch.is_grad_enabled() and not local.requires_grad:
            # Every rank's graph must hold the gather, whose backward is a collective, also a rank with no item.
            local.requires_grad_(True)
        gathered: torch.Tensor = _GatherShared.apply(local, self.group, self.rank, self.size)  # [sp, rows, H]
        out: list[torch.Tensor] = []
        for r in range(self.size):
            sizes_r = [int(n) for n in counts[r] if n >= 0]
            out.extend(torch.split(gathered[r, : sum(sizes_r)], sizes_r))
        return out

    def _max(self, value: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return value


def time_shares(patches: Sequence[int], size: int) -> list[int]:
    """The rank (0 … ``size − 1``) that encodes each temporal patch of a micro-batch's videos, given each one's patch
    count in order: contiguous shares of about ``total / size`` patches (a temporal patch goes to the share its
    first patch falls in)."""
    total, before, out = sum(patches), 0, []
    for n in patches:
        out.append(min(size - 1, before * size // total) if total else 0)
        before += n
    return out


def _pieces(
    frames: Sequence[tuple[int, int, int, int]], shares: Sequence[int], size: int
) -> list[list[tuple[int, int, int, int, int]]]:
    """Per rank of ``size``, its temporal patches as pieces of consecutive frames of one video: ``(prompt, grid
    row, first frame, frames, patches per frame)`` each, in order."""
    pieces: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(size)]
    for (i, row, k, area), rank in zip(frames, shares, strict=True):
        last = pieces[rank][-1] if pieces[rank] else None
        if last is not None and last[:2] == (i, row) and last[2] + last[3] == k:
            pieces[rank][-1] = (i, row, last[2], last[3] + 1, area)
        else:
            pieces[rank].append((i, row, k, 1, area))
    return pieces


class _Ctx(FunctionCtx):
    """What the exchanges' backward reads."""

    dims: tuple[int, int]
    group: dist.ProcessGroup
    size: int
    rank: int


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _Ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, size: int
    ) -> torch.Tensor:
        ctx.dims, ctx.group, ctx.size = (scatter_dim, gather_dim), group, size
        return _exchange(x, scatter_dim, gather_dim, group, size)

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group, ctx.size), None, None, None, None


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    if x.shape[scatter_dim] % size:
        raise ValueError(f"all-to-all: dimension {scatter_dim} of {tuple(x.shape)} does not split into {size}")
    inputs = [c.contiguous() for c in x.chunk(size, dim=scatter_dim)]
    outputs = [torch.empty_like(c) for c in inputs]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _GatherSlices(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _Ctx, local: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.rank = rank
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad[ctx.rank], None, None, None


class _GatherShared(torch.autograd.Function):
    """All-gather of tensors every rank then uses in its own part of the loss: the backward sums the ranks'
    gradients and hands each rank its own entry's."""

    @staticmethod
    def forward(ctx: _Ctx, local: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.group = rank, group
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        total = grad.contiguous()
        dist.all_reduce(total, group=ctx.group)
        return total[ctx.rank], None, None, None


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sequence_parallel: SequenceParallel | None = None,
    whole_mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **ignored: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: SDPA over the whole sequence with ``heads/sp`` heads per rank.

    Args:
        module: The attention layer.
        query: ``[B, h, s, d]`` this rank's ``s`` query positions, every (local) head, rope applied.
        key, value: ``[B, g, c + s, d]``: this rank's slice of the cached prefix (``c`` positions, 0 without a
            cache) followed by its ``s`` new positions.
        attention_mask: transformers' mask of the local shapes: used without ``sequence_parallel`` only.
        sequence_parallel: The group; None runs plain SDPA on what it is given.
        whole_mask: With ``sequence_parallel``, ``[B, 1, sp·s, sp·(c + s)]`` bool over the whole sequence (cached
            prefix first); None: plain causal attention (no cache, no padding), which SDPA runs without an
            ``S × S`` mask (its fused kernels, memory linear in the sequence).
        dropout, scaling: SDPA's.
        ignored: What else the layer passes (positions, sliding window: None for the families split here).

    Returns:
        ``([B, s, h, d] attention output of this rank's positions, None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sp = sequence_parallel
    if sp is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    s = query.shape[2]
    cached = key.shape[2] - s
    if key.shape[1] % sp.size:  # fewer key/value heads than ranks: each query head gets its own copy (GQA expanded)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)

    def to_heads(x: torch.Tensor) -> torch.Tensor:  # [B, n, t, d] → [B, n/sp, sp·t, d]
        return sp.all_to_all(x, scatter_dim=1, gather_dim=2)

    def whole(x: torch.Tensor) -> torch.Tensor:  # cached prefix and new positions, each in sequence order
        return torch.cat([to_heads(x[:, :, :cached]), to_heads(x[:, :, cached:])], dim=2) if cached else to_heads(x)

    if whole_mask is None and cached:
        raise ValueError("sequence-parallel attention over a cached prefix needs the whole sequence's mask")
    out = _sdpa(to_heads(query), whole(key), whole(value), whole_mask, dropout, scaling)  # [B, sp·s, h/sp, d]
    return sp.all_to_all(out, scatter_dim=1, gather_dim=2), None  # [B, s, h, d]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float, scale: float | None
) -> torch.Tensor:
    """``[B, n, T, d]`` queries over ``[B, m, K, d]`` keys and values (``m`` dividing ``n``: each key/value head serves
    ``n / m`` consecutive query heads, as transformers' ``repeat_kv``) → ``[B, T, n, d]``; causal when ``mask`` is
    None."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    causal = mask is None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, is_causal=causal)
    return out.transpose(1, 2).contiguous()


def check_sequence_parallel(model: torch.nn.Module, sp: int, tp: int = 1) -> None:
    """Raises ValueError unless ``sp`` ranks can split ``model``'s text decoder: it runs SDPA (or already the
    Ulysses attention) and ``sp`` divides its attention heads per tensor-parallel rank. Key/value heads that ``sp``
    does not divide are exchanged as one copy per query head (GQA expanded: more traffic, the same attention)."""
    decoder: Any = text_decoder(model)
    config = decoder.config
    attention = config._attn_implementation
    if attention not in ("sdpa", ULYSSES_ATTENTION):
        raise ValueError(
            f"sequence parallelism runs the decoder's SDPA attention over all-to-all exchanged heads; "
            f"{type(model).__name__}'s decoder uses {attention!r}: load it with attn_implementation='sdpa'"
        )
    heads = int(config.num_attention_heads)
    if heads % tp or (heads // tp) % sp:
        per = f" / tensor_parallel {tp} = {heads // tp}" if tp > 1 else ""
        raise ValueError(f"sequence_parallel={sp} must divide the decoder's attention heads: {heads}{per}")


def enable_sequence_parallel(model: torch.nn.Module) -> None:
    """Registers the Ulysses attention with transformers (under :data:`ULYSSES_ATTENTION`, with SDPA's mask) and
    makes it ``model``'s text decoder attention. Without a ``sequence_parallel`` argument it is plain SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ULYSSES_ATTENTION, sdpa_mask)
    decoder: Any = text_decoder(model)
    decoder.set_attn_implementation(ULYSSES_ATTENTION)


def prompt_mask_4d(prompt_mask: torch.Tensor) -> torch.Tensor:
    """``[U, 1, P, P]`` bool: causal attention over the real tokens of left-padded prompts (``[U, P]`` 1 on real
    tokens); a padding query sees itself only, so no row is empty (an empty row's softmax is NaN, and a NaN in a
    padding position's values would reach the real rows' gradients through ``0 · NaN``)."""
    p = prompt_mask.shape[1]
    causal = torch.ones(p, p, dtype=torch.bool, device=prompt_mask.device).tril()  # [P, P]
    allowed = causal[None] & prompt_mask.bool()[:, None, :]  # [U, P, P]
    return (allowed | torch.eye(p, dtype=torch.bool, device=prompt_mask.device)[None])[:, None]


def response_mask_4d(prompt_mask: torch.Tensor, feed_mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1, F, P + F]`` bool: each response input position sees its prompt's real tokens (``prompt_mask``
    ``[B, P]``, cached first) and its row's real earlier positions (``feed_mask`` ``[B, F]``): the mask one process
    builds from ``cat([prompt_mask, feed_mask])`` with the cache, over the whole sequence."""
    f = feed_mask.shape[1]
    causal = torch.ones(f, f, dtype=torch.bool, device=feed_mask.device).tril()  # [F, F]
    own = causal[None] & feed_mask.bool()[:, None, :]  # [B, F, F]
    prompt = prompt_mask.bool()[:, None, :].expand(-1, f, -1)  # [B, F, P]
    return torch.cat([prompt, own], dim=2)[:, None]


@dataclass
class _LocalStates:
    """This rank's slice of a micro-batch's response states, and where each column goes in the whole rows."""

    hidden: torch.Tensor  # [B, n, H] the states of this rank's score columns
    columns: torch.Tensor  # [n] the response position each column predicts, -1 for a padding column
    targets: torch.Tensor  # [B, L] whole rows' response ids
    valid: torch.Tensor  # [B, L] bool whole rows' scored tokens

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        """``[B, n, ...]``: this rank's columns of a ``[B, L, ...]`` tensor (column 0's for padding columns)."""
        return whole[:, self.columns.clamp(min=0)]

    @property
    def local_valid(self) -> torch.Tensor:
        return self.local(self.valid) & (self.columns >= 0)[None]


def _local_states(
    model: torch.nn.Module,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    suppressed_ids: Sequence[int],
    device: torch.device | str,
    sp: SequenceParallel,
) -> _LocalStates:
    """:class:`~relax_services.engines.scoring._ResponseStates` with the decoder's sequence split over ``sp``.

    Score column ``j`` (predicting response token ``j``) is the prompt's last state for ``j = 0`` (last column of
    the left-padded prompts: on the last rank) and response input ``j − 1``'s state otherwise; rank ``r`` runs
    response inputs ``[r·c, (r+1)·c)`` and so holds score columns ``r·c + 1 .. (r+1)·c`` (and 0 on the last rank).
    """
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"need as many responses as prompts (> 0), got {len(prompts)} and {len(responses)}")
    thinker: Any = model  # a transformers model: typed loosely
    pad_id = model_pad_id(thinker)
    banned = torch.tensor(sorted(suppressed_ids), dtype=torch.long)
    kept = [~torch.isin(r.long().cpu(), banned) for r in responses]
    clean = [torch.where(k, r.long().cpu(), pad_id) for r, k in zip(responses, kept, strict=True)]
    targets, response_mask = pad_sequences(clean, pad_id, side="right")  # [B, L]
    kept_padded, _ = pad_sequences([k.long() for k in kept], 0, side="right")  # [B, L]
    targets, response_mask = targets.to(device), response_mask.to(device)
    valid = kept_padded.to(device).bool() & response_mask.bool()
    decoder = text_decoder(thinker)
    n = sp.size

    distinct, row_prompt = distinct_prompts(prompts)
    row_prompt = row_prompt.to(device)
    ids, prompt_mask = pad_sequences([p.input_ids for p in distinct], pad_id, side="left")  # [U, P]
    positions, next_pos = sequence_positions(thinker, distinct, [0] * len(distinct), side="left")  # [3, U, P]
    extra = -ids.shape[1] % n  # more left padding: P' = P + extra, a multiple of sp
    ids = F.pad(ids, (extra, 0), value=pad_id).to(device)  # [U, P']
    prompt_mask = F.pad(prompt_mask, (extra, 0), value=0).to(device)  # [U, P']
    positions = F.pad(positions, (extra, 0), value=1).to(device)  # [3, U, P'] (pads at position 1, as one process)
    inputs = decoder_inputs(thinker, distinct, ids, device, encode=sp.share_encoding())
    if set(inputs) != {"inputs_embeds"}:
        raise ValueError("sequence parallelism does not split DeepStack vision features yet: use sequence_parallel=1")
    mine = sp.slice_of(ids.shape[1])
    embeds: torch.Tensor = inputs["inputs_embeds"][:, mine]  # type: ignore[call-overload]  # [U, P'/sp, H]
    sp.local_tokens += embeds.shape[0] * embeds.shape[1]
    prefix = decoder(
        inputs_embeds=embeds,
        position_ids=position_ids_for(thinker, positions)[..., mine],
        past_key_values=prompt_cache(decoder),
        use_cache=True,
        sequence_parallel=sp,
        # [U, 1, P', P'] the whole prompts'; none without padding (one prompt, P' = P): causal, no S × S mask
        whole_mask=None if bool(prompt_mask.all()) else prompt_mask_4d(prompt_mask),
    )
    first = prefix.last_hidden_state[row_prompt, -1:]  # [B, 1, H]: the prompt's last state on the last rank
    feed_len = targets.shape[1] - 1
    chunk = -(-feed_len // n)  # response inputs per rank
    if chunk:
        width = chunk * n
        feed = F.pad(targets[:, :-1], (0, width - feed_len), value=pad_id)  # [B, F] F = width
        feed_mask = F.pad(response_mask[:, :-1], (0, width - feed_len), value=0)  # [B, F]
        cache = prefix.past_key_values.continuation(row_prompt)  # this rank's slice of each row's prompt
        steps = torch.arange(width, device=targets.device)
        feed_pos = position_ids_for(thinker, (next_pos.to(device)[row_prompt, None] + steps).expand(3, -1, -1))
        mine = sp.slice_of(width)
        sp.local_tokens += feed.shape[0] * chunk
        rest = decoder(
            inputs_embeds=thinker.get_input_embeddings()(feed[:, mine]),  # [B, c, H]
            position_ids=feed_pos[..., mine],
            past_key_values=cache,
            use_cache=True,
            sequence_parallel=sp,
            whole_mask=response_mask_4d(prompt_mask[row_prompt], feed_mask),  # [B, 1, F, P' + F]
        ).last_hidden_state  # [B, c, H]
        hidden = torch.cat([first, rest], dim=1)  # [B, c + 1, H]
    else:
        hidden = first
    return _LocalStates(hidden, _columns(sp.rank, n, chunk, feed_len, valid.device), targets, valid)


def _columns(rank: int, size: int, chunk: int, feed_len: int, device: torch.device) -> torch.Tensor:
    """``[chunk + 1]``: the score column each of rank ``rank``'s states predicts (:func:`_local_states`' rule), -1
    for a padding column (column 0 on a rank other than the last; past the longest response)."""
    cols = torch.tensor([0 if rank == size - 1 else -1] + [rank * chunk + k + 1 for k in range(chunk)], device=device)
    return cols.masked_fill(cols > feed_len, -1)


def _whole_rows(states: _LocalStates, sp: SequenceParallel, local: torch.Tensor) -> list[torch.Tensor]:
    """``k`` whole ``[B, L]`` rows from every rank's ``[k, B, n]`` local columns (0 where not valid); each its own
    tensor, not a view (FSDP's root must not return views)."""
    gathered = sp.gather_slices(local)  # [sp, k, B, n]
    chunk, feed_len = states.columns.shape[0] - 1, states.valid.shape[1] - 1
    everyone = torch.stack([_columns(r, sp.size, chunk, feed_len, states.valid.device) for r in range(sp.size)])
    take = everyone >= 0  # [sp, n]
    values = gathered.permute(1, 2, 0, 3)[:, :, take]  # [k, B, m] every real column once
    whole = local.new_zeros((*local.shape[:2], states.valid.shape[1]))  # [k, B, L]
    return [x.clone() for x in (whole.index_copy(2, everyone[take], values) * states.valid).unbind(0)]


def score_responses_sp(
    model: torch.nn.Module,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    sp: SequenceParallel,
    temperature: float = 1.0,
    suppressed_ids: Sequence[int] = (),
    device: torch.device | str = "cpu",
    *,
    reference: FrozenReference | None = None,
    chunk_tokens: int = 1024,
) -> TokenScores:
    """:func:`~relax_services.engines.score_responses` with the sequence split over ``sp`` (collective over its
    group): the same whole ``[B, L]`` scores on every rank of it, to float rounding."""
    states = _local_states(model, prompts, responses, suppressed_ids, device, sp)
    lm_head = cast(torch.nn.Module, model.lm_head)
    valid = states.local_valid  # [B, n]
    targets = states.local(states.targets)
    if reference is None:
        logp, entropy = token_scores(lm_head, states.hidden, targets, valid, temperature, suppressed_ids, chunk_tokens)
        whole = _whole_rows(states, sp, torch.stack([logp, entropy]))
        return TokenScores(logprobs=whole[0], entropy=whole[1], mask=states.valid.float())
    ref_hidden = states.local(reference.hidden(prompts, responses, suppressed_ids, device))  # [B, n, H], no grad
    logp, entropy, kl = token_scores_with_kl(
        lm_head,
        states.hidden,
        reference.lm_head,
        ref_hidden,
        targets,
        valid,
        temperature,
        suppressed_ids,
        chunk_tokens,
    )
    whole = _whole_rows(states, sp, torch.stack([logp, entropy, kl]))
    return TokenScores(logprobs=whole[0], entropy=whole[1], mask=states.valid.float(), full_kl=whole[2])


def score_values_sp(
    model: ValueModel,
    prompts: Sequence[OmniPrompt],
    responses: Sequence[torch.Tensor],
    sp: SequenceParallel,
    suppressed_ids: Sequence[int] = (),
    device: torch.device | str = "cpu",
) -> TokenScores:
    """:func:`~relax_services.engines.score_values` with the sequence split over ``sp``."""
    states = _local_states(model.thinker, prompts, responses, suppressed_ids, device, sp)
    values = model.value_head(states.hidden)[..., 0]  # [B, n]
    whole = _whole_rows(states, sp, values[None].float())[0]
    zeros = torch.zeros(states.valid.shape, device=states.valid.device)
    return TokenScores(logprobs=zeros, entropy=zeros, mask=states.valid.float(), values=whole)
