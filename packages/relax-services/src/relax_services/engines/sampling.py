"""Sampling parameters and the per-step token sampler shared by the rollout engine and its tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from relax_services.models.policy import checkpoint_of

if TYPE_CHECKING:
    from relax_services.config import ModelConfig


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled.

    Attributes:
        n: Completions per prompt (the GRPO group size); they share one prompt forward.
        max_new_tokens: Generated tokens per completion at most (the eos included).
        temperature: Softmax temperature; ``0`` is greedy (argmax).
        top_k: Keep only the ``top_k`` most likely ids; ``0`` keeps all.
        top_p: Nucleus sampling: keep the smallest set of ids whose probability reaches ``top_p``; ``1`` keeps all.
        suppressed_ids: Ids never sampled (their logits are set to −∞ before anything else): the checkpoint's
            never-sample ids (:attr:`~relax_services.models.TokenIds.never_sample`).
        eos_id: Id that ends a completion (the checkpoint's eos); ``None``: completions run to ``max_new_tokens``.
    """

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    suppressed_ids: tuple[int, ...] = ()
    eos_id: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.eos_id is not None and self.eos_id in self.suppressed_ids:
            raise ValueError(f"SamplingParams.eos_id {self.eos_id} is also in suppressed_ids")

    @property
    def greedy(self) -> bool:
        """Whether decoding is argmax."""
        return self.temperature == 0


def policy_logprobs(logits: torch.Tensor, temperature: float, suppressed_ids: Sequence[int]) -> torch.Tensor:
    """Log-probabilities of the policy distribution the behaviour log-probs refer to.

    This is ``log_softmax(logits / T)`` over the vocabulary without the suppressed ids (greedy decoding
    uses ``T = 1``). The training engine computes the same distribution, so rollout and trainer
    log-probs are comparable; top-k / top-p truncation is not part of it.

    Args:
        logits: ``[..., V]``.
        temperature: Sampling temperature; ``0`` means 1 here.
        suppressed_ids: Ids removed from the support.

    Returns:
        ``[..., V]`` float32 log-probs (float64 for float64 logits), ``-inf`` at suppressed ids.
    """
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / (temperature if temperature > 0 else 1.0)
    if suppressed_ids:
        scaled = scaled.index_fill(-1, torch.tensor(list(suppressed_ids), device=logits.device), float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def truncate(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Applies top-k then top-p to ``[R, V]`` log-probs and renormalises; removed ids get ``-inf``."""
    out = logprobs
    if top_k and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]  # [R, 1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(out, dim=-1, descending=True)  # [R, V]
        probs = sorted_lp.exp()
        # Keep an id if the mass strictly before it is below top_p (so the top id is always kept).
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    if out is logprobs:
        return out
    return torch.log_softmax(out, dim=-1)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples one token per row by inverse-CDF with pre-drawn uniforms.

    Drawing the uniforms outside (one per row and step) makes a row's sample independent of which other
    rows are in the batch, so shared-prompt and repeated-prompt decoding give the same tokens.

    Args:
        logits: ``[R, V]`` next-token logits.
        params: Sampling parameters.
        uniforms: ``[R]`` draws from U(0, 1); ignored when greedy.

    Returns:
        ``(tokens [R], behaviour_logprobs [R], sampling_logprobs [R])``: the log-prob of each token under
        :func:`policy_logprobs` and under the truncated distribution actually sampled from.
    """
    logp = policy_logprobs(logits, params.temperature, params.suppressed_ids)  # [R, V]
    if params.greedy:
        tokens = logp.argmax(-1)
        chosen = logp.gather(-1, tokens[:, None])[:, 0]
        return tokens, chosen, torch.zeros_like(chosen)
    trunc = truncate(logp, params.top_k, params.top_p)  # [R, V]
    cdf = trunc.exp().cumsum(-1)  # [R, V]
    u = uniforms.to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u).clamp_max(cdf.shape[-1] - 1)[:, 0]  # [R]
    # Guard against landing on a zero-probability id at a flat stretch of the CDF.
    tokens = torch.where(torch.isinf(trunc.gather(-1, tokens[:, None])[:, 0]), trunc.argmax(-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0], trunc.gather(-1, tokens[:, None])[:, 0]


def sampling_params(cfg: ModelConfig, **kwargs: Any) -> SamplingParams:
    """Sampling parameters with the checkpoint's eos and never-sample ids."""
    tokens = checkpoint_of(cfg).tokens
    return SamplingParams(suppressed_ids=tokens.never_sample, eos_id=tokens.eos_id, **kwargs)
