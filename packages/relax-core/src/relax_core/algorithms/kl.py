"""KL estimators, entropy and the clipped value loss."""

from __future__ import annotations

import torch
from torch import Tensor

from relax_core._names import KLEstimator, LossAggMode
from relax_core.algorithms.masked import aggregate_loss, masked_mean, masked_var

__all__ = [
    "KLEstimator",
    "entropy_from_logits",
    "kl_estimate",
    "kl_full",
    "kl_penalised_rewards",
    "token_logprobs",
    "value_loss",
]


_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
"""verl's names for the same estimators (``low_var_kl`` is k3 with the ±10 clamp, this module's default)."""


def kl_estimate(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3", clamp: float | None = 10.0
) -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman 2020, "Approximating KL").

    With log r = log π_ref − log π_θ:
    k1 = −log r (unbiased, high variance), k2 = ½ (log r)² (biased, low variance),
    k3 = r − 1 − log r (unbiased, non-negative, low variance), abs = |log r|.
    ``k1+`` and ``k3+`` are straight-through estimators: the value of k1 (k3) and the gradient of k2,
    −log r · ∇log π_θ, whose expectation under π_θ is the gradient of KL(π_θ ‖ π_ref) (k1's and k3's own
    gradients in the loss are not: E[∇k1] = 0). verl's names ``kl``, ``mse`` and ``low_var_kl`` are k1, k2, k3.

    Args:
        logprobs: log π_θ of the sampled tokens ``[B, T]``.
        ref_logprobs: log π_ref of the same tokens ``[B, T]``.
        estimator: ``k1``, ``k2``, ``k3``, ``abs``, ``k1+``, ``k3+`` or an alias (``kl``, ``mse``, ``low_var_kl``).
        clamp: The estimate is clamped to [−clamp, clamp] (and k3's log r to ±20 before ``exp``), the
            low-variance clamp that keeps one outlier token from dominating; None disables it. A straight-through
            estimator clamps its value only; its gradient is k2's, unclamped.

    Returns:
        KL estimate ``[B, T]``; differentiable w.r.t. ``logprobs``.
    """
    if estimator == "full":
        raise ValueError("the 'full' KL needs both distributions over the vocabulary: use kl_full")
    name = _ALIASES.get(estimator, estimator)
    straight_through = name in ("k1+", "k3+")
    base = name.rstrip("+")
    log_r = ref_logprobs - logprobs  # [B, T]
    if base == "k1":
        kl = -log_r
    elif base == "k2":
        kl = 0.5 * log_r**2
    elif base == "k3":
        clamped = torch.clamp(log_r, -20.0, 20.0)
        kl = torch.exp(clamped) - 1.0 - clamped
    elif base == "abs":
        kl = log_r.abs()
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; allowed: k1, k2, k3, abs, k1+, k3+, kl, mse, low_var_kl")
    kl = torch.clamp(kl, -clamp, clamp) if clamp is not None else kl
    if straight_through:
        k2 = 0.5 * log_r**2  # [B, T]; carries the gradient
        kl = kl.detach() + k2 - k2.detach()
    return kl


def kl_full(logprob_dist: Tensor, ref_dist: Tensor, clamp: float | None = 10.0) -> Tensor:
    """Exact per-position KL(π_ref ‖ π_θ) = Σ_v π_ref(v) (log π_ref(v) − log π_θ(v)) over the vocabulary.

    Its gradient is −Σ_v π_ref(v) ∇log π_θ(v): the expectation of what k3 in the loss estimates from the
    sampled tokens alone. The sampled estimate is blind to tokens the policy no longer samples, so once an
    option's probability has collapsed to ~0 nothing raises it again; this form raises every token the
    reference supports, sampled or not.

    Args:
        logprob_dist: log π_θ over the vocabulary ``[B, T, V]``, with gradient (``-inf`` outside the support).
        ref_dist: log π_ref over the vocabulary ``[B, T, V]`` (``-inf`` outside the support).
        clamp: The per-position value is clamped to at most ``clamp``; None disables it.

    Returns:
        ``[B, T]`` KL per position; differentiable w.r.t. ``logprob_dist``.
    """
    if logprob_dist.shape != ref_dist.shape or logprob_dist.ndim != 3:
        raise ValueError(
            f"logprob_dist and ref_dist must both be [B, T, V], got {tuple(logprob_dist.shape)} and "
            f"{tuple(ref_dist.shape)}"
        )
    support = torch.isfinite(ref_dist)
    zero = torch.zeros((), dtype=logprob_dist.dtype, device=logprob_dist.device)
    # Clamp log π_θ from below so a token the reference supports but the policy excludes gives a large finite term.
    log_ratio = torch.where(support, ref_dist - logprob_dist.clamp_min(-100.0), zero)  # [B, T, V]
    kl = (torch.where(support, ref_dist.exp(), zero) * log_ratio).sum(-1)  # [B, T]
    return _clamp_full_kl(kl, clamp)


def _clamp_full_kl(kl: Tensor, clamp: float | None) -> Tensor:
    """:func:`kl_full`'s clamp of per-position values ``[...]`` to at most ``clamp`` (None: unchanged); the loss
    applies it to a KL summed elsewhere (a training engine's chunks of the vocabulary)."""
    return torch.clamp(kl, max=clamp) if clamp is not None else kl


def kl_penalised_rewards(
    rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    coef: float,
    estimator: KLEstimator = "k1",
    clamp: float | None = 10.0,
) -> Tensor:
    """Token rewards with the KL penalty folded in: r_t − β · KL_t on valid tokens (InstructGPT style).

    Args:
        rewards: Token rewards ``[B, T]``.
        logprobs: Behaviour (or proximal) log-probs ``[B, T]``.
        ref_logprobs: Reference log-probs ``[B, T]``.
        mask: Valid tokens ``[B, T]``.
        coef: β.
        estimator, clamp: As in :func:`kl_estimate`.

    Returns:
        Penalised rewards ``[B, T]`` (no gradient).
    """
    with torch.no_grad():
        kl = kl_estimate(logprobs, ref_logprobs, estimator, clamp)
        return torch.where(mask.bool(), rewards - coef * kl, rewards)


def token_logprobs(logits: Tensor, token_ids: Tensor) -> Tensor:
    """log p(token) under ``logits``: ``[..., V]`` and ``[...]`` → ``[...]`` (computed in float32).

    Shift before calling: for a causal LM the logits at position j score token j + 1.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position: ``[..., V]`` → ``[...]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None = 0.2,
    agg_mode: LossAggMode = "token-mean",
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss (PPO as in OpenAI baselines; Schulman et al. 2017 §5):
    ½ · max((V − R)², (V_old + clip(V − V_old, ±ε) − R)²).

    Args:
        values: Current critic values ``[B, T]``.
        old_values: Critic values when the data was scored ``[B, T]``.
        returns: Regression targets (GAE returns or V-trace targets) ``[B, T]``.
        mask: Valid tokens ``[B, T]``.
        clip_eps: ε; None gives the plain squared error.
        agg_mode: Aggregation mode (see :func:`aggregate_loss`).

    Returns:
        ``(loss, diagnostics)`` with ``vf_clipfrac`` and ``vf_explained_var``.
    """
    mask_b = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(mask_b, values, zero)
    old_values = torch.where(mask_b, old_values, zero)
    returns = torch.where(mask_b, returns, zero)
    unclipped = (values - returns) ** 2  # [B, T]
    if clip_eps is None:
        per_token = 0.5 * unclipped
        clipped_more = torch.zeros_like(mask_b)
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
        clipped = (clipped_values - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipped_more = clipped > unclipped
    loss = aggregate_loss(per_token, mask, agg_mode)
    with torch.no_grad():
        residual_var = masked_var(returns - values, mask)
        return_var = masked_var(returns, mask)
        diagnostics = {
            "vf_loss": float(loss.item()),
            "vf_clipfrac": float(masked_mean(clipped_more.float(), mask).item()),
            "vf_explained_var": float((1.0 - residual_var / return_var.clamp(min=1e-8)).item()),
        }
    return loss, diagnostics
