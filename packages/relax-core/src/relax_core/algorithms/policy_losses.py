"""Per-token policy surrogates and off-policy importance corrections.

Every surrogate takes the log-ratio log π_θ − log π_anchor ``[B, T]`` (the anchor is the proximal
policy in decoupled PPO, else the behaviour policy) and advantages ``[B, T]``, and returns the
per-token loss to minimise plus a bool ``[B, T]`` marking tokens where its clip (or gate) is active.
Masking and aggregation happen in :func:`~relax_core.compute_policy_loss`.

Every ratio is ``exp`` of a log-ratio clamped to ``±LOG_RATIO_BOUND`` (20, as verl and OpenRLHF do):
one token whose behaviour log-prob is −100 would otherwise give exp(99) = inf in float32, and the
backward pass multiplies that inf by the zero gradient of the branch ``max``/``clamp`` did not take,
which is NaN for the whole step even though the loss value can stay finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from relax_core.algorithms.masked import masked_mean

__all__ = [
    "LOG_RATIO_BOUND",
    "ImportanceWeights",
    "cispo_loss",
    "gspo_log_ratio",
    "importance_weights",
    "ppo_clip_loss",
    "sapo_loss",
]

LOG_RATIO_BOUND = 20.0
"""Log-ratios are clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` before ``exp`` (e^20 ≈ 4.9e8)."""


def clamped_ratio(log_ratio: Tensor) -> Tensor:
    """``exp(clamp(log_ratio, ±LOG_RATIO_BOUND))``: finite in float32, zero gradient outside the bound."""
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def ppo_clip_loss(
    log_ratio: Tensor,
    advantages: Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with asymmetric ε (DAPO clip-higher, Yu et
    al. 2025, eq. 10) and optional dual clip (Ye et al. 2020, eq. 5).

    ℓ_t = −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t); with dual clip, for A_t < 0 the loss is
    further capped at −c · A_t. r_t is computed from the log-ratio clamped to ±`LOG_RATIO_BOUND`.

    Args:
        log_ratio: log π_θ − log π_anchor ``[B, T]``.
        advantages: ``[B, T]``.
        clip_eps_low, clip_eps_high: ε_low, ε_high.
        dual_clip_c: c > 1, or None.

    Returns:
        ``(loss, clipped, dual_clipped)``: per-token loss ``[B, T]``; bool ``[B, T]`` where the clipped
        branch is taken; bool ``[B, T]`` where the dual-clip bound is taken.
    """
    ratio = clamped_ratio(log_ratio)  # [B, T]
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    dual = torch.zeros_like(is_clipped)
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return loss, is_clipped, dual


def gspo_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token log-ratio (Zheng et al. 2025, eqs. 7 and 13).

    log s_{i,t} = sg[log s_i] + log π_θ(y_t) − sg[log π_θ(y_t)].

    s_i = exp(mean_t log(π_θ/π_anchor)) is the length-normalised sequence ratio. Every token of a
    sequence carries the value s_i, and the gradient of each token's term is s_i ∇log π_θ(y_t), so
    with sequence-constant advantages and seq-mean-token-mean aggregation this is exactly GSPO's
    sequence objective. Feed the result to :func:`ppo_clip_loss`.

    Args:
        log_ratio: ``[B, T]``.
        mask: Valid tokens ``[B, T]``.

    Returns:
        Per-token log-ratio ``[B, T]``.
    """
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)  # [B, 1]
    return seq_log_ratio.detach() + log_ratio - log_ratio.detach()


def cispo_loss(
    log_ratio: Tensor, advantages: Tensor, clip_eps_low: float, clip_eps_high: float
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, 2025, eq. 4): J = sg(clip(r, 1 − ε_low, 1 + ε_high)) · A · log π_θ.

    Every token keeps its gradient; only the (detached) IS weight is clipped. We write the term as
    −sg(r̂) · A · exp(log r − sg(log r)), whose gradient is the paper's −sg(r̂) · A · ∇log π_θ and
    whose value is −r̂ · A (comparable with PPO's).

    Returns:
        ``(loss, clipped)``, each ``[B, T]``.
    """
    ratio = clamped_ratio(log_ratio.detach())
    weight = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = -weight * advantages * torch.exp(log_ratio - log_ratio.detach())
    return loss, weight != ratio


def sapo_loss(log_ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> tuple[Tensor, Tensor]:
    """SAPO soft-gated surrogate (Gao et al. 2025, "Soft Adaptive Policy Optimization", eqs. 5–6).

    J = f(r) · A with f(r) = (4/τ) · σ(τ (r − 1)); τ = τ_pos for A > 0 and τ_neg otherwise. The
    gradient weight 4 σ(1 − σ) is 1 at r = 1 and decays smoothly away from it, instead of a hard clip.
    r is computed from the log-ratio clamped to ±`LOG_RATIO_BOUND`.

    Returns:
        ``(loss, gated)``: per-token loss ``[B, T]``; bool ``[B, T]`` where the gradient weight is
        below one half (the soft analogue of "clipped").
    """
    tau = torch.where(advantages > 0, torch.full_like(advantages, tau_pos), torch.full_like(advantages, tau_neg))
    gate = torch.sigmoid(tau * (clamped_ratio(log_ratio) - 1.0))  # [B, T]
    loss = -(4.0 / tau) * gate * advantages
    with torch.no_grad():
        gated = 4.0 * gate * (1.0 - gate) < 0.5
    return loss, gated


@dataclass(frozen=True)
class ImportanceWeights:
    """Behaviour → proximal correction for decoupled PPO and rollout/trainer mismatch.

    Attributes:
        weights: Per-token weight π_prox/π_behaviour after truncation ``[B, T]`` (no gradient).
        keep: Bool ``[B, T]``: false where masked IS rejected the token (or its whole sequence).
        raw: The untruncated ratio ``[B, T]``.
        truncated: Bool ``[B, T]``: where the TIS cap was applied.
    """

    weights: Tensor
    keep: Tensor
    raw: Tensor
    truncated: Tensor


def importance_weights(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    tis_cap: float | None = None,
    mis_level: Literal["none", "token", "sequence"] = "none",
    mis_low: float = 0.5,
    mis_high: float = 2.0,
) -> ImportanceWeights:
    """Off-policy correction weights w = π_prox / π_behaviour.

    Decoupled PPO (Hilton et al. 2022, eq. 6) multiplies each token's clipped surrogate by w.
    Truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training") caps w at ``tis_cap``. Masked IS rejects instead of truncating: token level (IcePop,
    Ling team 2025) drops tokens with w ∉ [mis_low, mis_high]; sequence level (Liu et al. 2025,
    "When speed kills stability") drops whole sequences whose geometric-mean ratio
    exp(mean_t log w_t) falls outside that range.

    Args:
        proximal_logprobs: log π_prox ``[B, T]`` (trainer, before the update).
        behaviour_logprobs: log μ ``[B, T]`` (rollout engine, possibly stale).
        mask: Valid tokens ``[B, T]``.
        tis_cap: Truncation level, or None.
        mis_level: ``none``, ``token`` or ``sequence``.
        mis_low, mis_high: Acceptance range for masked IS.
    """
    with torch.no_grad():
        mask_b = mask.bool()
        log_w = torch.where(mask_b, proximal_logprobs - behaviour_logprobs, torch.zeros_like(proximal_logprobs))
        raw = clamped_ratio(log_w)  # [B, T]
        weights = raw if tis_cap is None else torch.clamp(raw, max=tis_cap)
        truncated = mask_b & (raw > tis_cap) if tis_cap is not None else torch.zeros_like(mask_b)
        if mis_level == "token":
            keep = (raw >= mis_low) & (raw <= mis_high)
        elif mis_level == "sequence":
            seq_ratio = torch.exp(masked_mean(log_w, mask_b, dim=-1))  # [B]
            keep = ((seq_ratio >= mis_low) & (seq_ratio <= mis_high)).unsqueeze(-1).expand_as(mask_b)
        elif mis_level == "none":
            keep = torch.ones_like(mask_b)
        else:
            raise ValueError(f"unknown mis_level {mis_level!r}; allowed: none, token, sequence")
    return ImportanceWeights(weights=weights, keep=keep & mask_b, raw=raw, truncated=truncated)
