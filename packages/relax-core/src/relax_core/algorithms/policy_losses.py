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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from relax_core.algorithms.masked import masked_mean, masked_sum

__all__ = [
    "LOG_RATIO_BOUND",
    "ImportanceWeights",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_loss",
    "dro_loss",
    "geo_mean_loss",
    "gspo_log_ratio",
    "importance_weights",
    "kl_cov_loss",
    "pg_loss",
    "ppo_clip_loss",
    "rejection_keep",
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


def pg_loss(logprobs: Tensor, advantages: Tensor) -> Tensor:
    """Plain policy gradient, REINFORCE (Williams 1992) and GPG (Chu et al. 2025, "GPG: a simple and strong
    reinforcement learning baseline for model reasoning"): ℓ_t = −A_t · log π_θ(y_t), its value as well as its gradient.

    No ratio and no clip: the gradient is −A_t ∇log π_θ, on-policy by construction (off-policy data is
    corrected by the importance weights that :func:`~relax_core.compute_policy_loss` multiplies in).

    Args:
        logprobs: log π_θ ``[B, T]``, with gradient.
        advantages: ``[B, T]``.

    Returns:
        Per-token loss ``[B, T]``.
    """
    return -advantages * logprobs


def dro_loss(logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, beta: float) -> Tensor:
    """DRO, direct reward optimisation with a quadratic regulariser (Richemond et al. 2024, "Offline regularised
    reinforcement learning for large language models alignment", as verl's ``dro``):
    ℓ_t = −(A_t · log π_θ(y_t) − β/2 · (log π_θ(y_t) − log π_anchor(y_t))²).

    Args:
        logprobs: log π_θ ``[B, T]``, with gradient.
        log_ratio: log π_θ − log π_anchor ``[B, T]``, with gradient.
        advantages: ``[B, T]``.
        beta: β > 0, the weight of the squared log-ratio.

    Returns:
        Per-token loss ``[B, T]``.
    """
    return -(advantages * logprobs - 0.5 * beta * log_ratio**2)


def geo_mean_loss(
    log_ratio: Tensor, advantages: Tensor, mask: Tensor, clip_eps_low: float, clip_eps_high: float
) -> tuple[Tensor, Tensor]:
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv 2507.20673).

    L_i = −Ā_i · exp(mean_t sgn(Ā)·min(sgn(Ā)·log r_t, sgn(Ā)·clip(log r_t, −ε_low, ε_high))): the sequence ratio
    is the geometric mean of its token ratios, each clipped in log space on the side the advantage pushes, and
    Ā_i is the sequence's token-mean advantage. Every token of sequence i carries the value L_i, so
    ``seq-mean-token-mean`` aggregation gives the mean over sequences that verl's ``geo_mean`` takes whatever its
    ``loss_agg_mode`` (verl ignores the mode; relax applies it, and its GMPO choice is ``seq-mean-token-mean``).

    Args:
        log_ratio: log π_θ − log π_anchor ``[B, T]``, with gradient.
        advantages: ``[B, T]`` (sequence-constant for the paper's objective).
        mask: Valid tokens ``[B, T]``.
        clip_eps_low, clip_eps_high: ε_low, ε_high, bounds on the log-ratio.

    Returns:
        ``(loss, clipped)``: per-token loss ``[B, T]``; bool ``[B, T]`` where the token's log-ratio is clipped.
    """
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    seq_adv = masked_mean(advantages, mask, dim=-1)  # [B]
    sign = torch.sign(seq_adv).unsqueeze(-1)  # [B, 1]
    clamped = torch.clamp(log_ratio, -clip_eps_low, clip_eps_high)  # [B, T]
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)  # [B, T]
    seq_ratio = torch.exp(masked_mean(pessimistic, mask, dim=-1))  # [B]
    loss = (-seq_adv * seq_ratio).unsqueeze(-1).expand_as(log_ratio)  # [B, T]
    return loss, log_ratio.detach() != clamped.detach()


def _covariance(advantages: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token centred product (A_t − mean A)(log π_t − mean log π) over the valid tokens ``[B, T]`` (detached)."""
    with torch.no_grad():
        return (advantages - masked_mean(advantages, mask)) * (logprobs - masked_mean(logprobs, mask))


def clip_cov_loss(
    log_ratio: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    ratio: float,
    cov_low: float,
    cov_high: float,
) -> tuple[Tensor, Tensor]:
    """Clip-Cov (Cui et al. 2025, "The entropy mechanism of reinforcement learning for reasoning language models",
    §4): the PPO clipped surrogate with the gradient of a few high-covariance tokens cut.

    Cov_t = (A_t − mean A)(log π_t − mean log π) over the batch's valid tokens. Among the valid tokens PPO's clip
    has not already stopped whose Cov_t lies in (cov_low, cov_high), max(⌊ratio · N⌋, 1) are drawn uniformly
    (torch's global generator, so a seeded run repeats) and their loss is multiplied by 0, as verl's
    ``clip_cov`` does.

    Args:
        log_ratio: log π_θ − log π_anchor ``[B, T]``, with gradient.
        logprobs: log π_θ ``[B, T]`` (only its detached value enters the covariance).
        advantages, mask: ``[B, T]``.
        clip_eps_low, clip_eps_high: PPO's ε_low, ε_high.
        ratio: Share of the N valid tokens to cut.
        cov_low, cov_high: The covariance window of the candidates.

    Returns:
        ``(loss, cut)``: per-token loss ``[B, T]``; bool ``[B, T]`` where PPO clipped or Clip-Cov cut the token.
    """
    mask_b = mask.bool()
    loss, clipped, _ = ppo_clip_loss(log_ratio, advantages, clip_eps_low, clip_eps_high)
    cov = _covariance(advantages, logprobs, mask_b)  # [B, T]
    candidates = (mask_b & ~clipped & (cov > cov_low) & (cov < cov_high)).flatten().nonzero().squeeze(-1)  # [K]
    count = min(max(int(ratio * int(mask_b.sum())), 1), candidates.numel())
    cut = torch.zeros(mask_b.numel(), dtype=torch.bool, device=mask_b.device)
    if count > 0:
        cut[candidates[torch.randperm(candidates.numel(), device="cpu")[:count].to(candidates.device)]] = True
    cut = cut.view_as(mask_b)
    return torch.where(cut, torch.zeros_like(loss), loss), clipped | cut


def kl_cov_loss(
    log_ratio: Tensor, logprobs: Tensor, advantages: Tensor, mask: Tensor, ratio: float, coef: float
) -> tuple[Tensor, Tensor]:
    """KL-Cov (Cui et al. 2025, "The entropy mechanism of reinforcement learning for reasoning language models",
    §4): the unclipped surrogate −A_t r_t, plus coef · |log r_t| on the top max(⌊ratio · N⌋, 1) valid
    tokens by covariance Cov_t = (A_t − mean A)(log π_t − mean log π), as verl's ``kl_cov``.

    Args:
        log_ratio: log π_θ − log π_anchor ``[B, T]``, with gradient.
        logprobs: log π_θ ``[B, T]`` (only its detached value enters the covariance).
        advantages, mask: ``[B, T]``.
        ratio: Share of the N valid tokens that get the penalty.
        coef: Weight of |log r| on those tokens (verl's ``ppo_kl_coef``).

    Returns:
        ``(loss, penalised)``: per-token loss ``[B, T]``; bool ``[B, T]`` marking the penalised tokens.
    """
    mask_b = mask.bool()
    loss = -advantages * clamped_ratio(log_ratio)  # [B, T]
    valid = int(mask_b.sum())
    penalised = torch.zeros(mask_b.numel(), dtype=torch.bool, device=mask_b.device)
    if valid > 0:
        cov = torch.where(mask_b, _covariance(advantages, logprobs, mask_b), -torch.inf).flatten()  # [B·T]
        penalised[torch.topk(cov, max(int(valid * ratio), 1)).indices] = True
    penalised = penalised.view_as(mask_b)
    return torch.where(penalised, loss + coef * log_ratio.abs(), loss), penalised


def dppo_loss(
    logprobs: Tensor,
    anchor_logprobs: Tensor,
    advantages: Tensor,
    delta_low: float,
    delta_high: float,
    ratio_cap: float,
    divergence: Literal["tv", "kl"],
) -> tuple[Tensor, Tensor]:
    """DPPO-Binary-TV / -KL (Qi et al. 2026, "Rethinking the trust region in LLM reinforcement learning", arXiv
    2602.04879): a token's gradient is kept unless the policy has left a trust region around the anchor, measured
    on the sampled token's probability, in the direction its advantage pushes.

    ℓ_t = −A_t · sg(min(r_t, ratio_cap)) · log π_θ(y_t) · m_t (the value as verl writes it; its gradient is
    −A_t min(r_t, c) ∇log π_θ, PPO's unclipped gradient up to the cap). With p = π_θ(y_t), q = π_anchor(y_t):
    ``tv``: m_t = [p − q ≤ δ_high] for A_t > 0, [p − q ≥ −δ_low] otherwise;
    ``kl``: with the Bernoulli KL D = q log(q/p) + (1 − q) log((1 − q)/(1 − p)), m_t = [D ≤ δ_high or p ≤ q] for
    A_t > 0, [D ≤ δ_low or p ≥ q] otherwise.

    Args:
        logprobs: log π_θ ``[B, T]``, with gradient.
        anchor_logprobs: log π_anchor ``[B, T]``.
        advantages: ``[B, T]``.
        delta_low, delta_high: The trust region's bounds (``clip_eps_low``, ``clip_eps_high``).
        ratio_cap: c, the truncation of the (detached) ratio.
        divergence: ``tv`` or ``kl``.

    Returns:
        ``(loss, outside)``: per-token loss ``[B, T]``; bool ``[B, T]`` where the token left the trust region.
    """
    with torch.no_grad():
        lp, anchor = logprobs.detach(), anchor_logprobs.detach()
        weight = torch.clamp(clamped_ratio(lp - anchor), max=ratio_cap)  # [B, T]
        p, q = torch.exp(lp), torch.exp(anchor)
        if divergence == "tv":
            keep_pos, keep_neg = p - q <= delta_high, p - q >= -delta_low
        elif divergence == "kl":
            tiny = 1e-8  # keeps log((1 − q)/(1 − p)) finite at p or q = 1, as verl does
            binary_kl = q * (anchor - lp) + (1.0 - q) * torch.log((1.0 - q + tiny) / (1.0 - p + tiny))
            keep_pos, keep_neg = (binary_kl <= delta_high) | (p <= q), (binary_kl <= delta_low) | (p >= q)
        else:
            raise ValueError(f"unknown DPPO divergence {divergence!r}; allowed: tv, kl")
        keep = torch.where(advantages > 0, keep_pos, keep_neg)  # [B, T]
    loss = -advantages * weight * logprobs
    return torch.where(keep, loss, torch.zeros_like(loss)), ~keep


@dataclass(frozen=True)
class ImportanceWeights:
    """Behaviour → proximal correction for decoupled PPO and rollout/trainer mismatch.

    Attributes:
        weights: Per-token weight π_prox/π_behaviour after truncation (and batch normalisation) ``[B, T]``, no
            gradient; at sequence level every token of a sequence holds the sequence's weight.
        keep: Bool ``[B, T]``: false where masked IS or a rejection rule dropped the token (or its whole sequence).
        raw: The untruncated weight ``[B, T]`` (per token, or the sequence's product at sequence level).
        truncated: Bool ``[B, T]``: where a TIS cap was applied.
        rejected: Bool ``[B, T]``: valid tokens the ``rollout_rs`` rules dropped.
    """

    weights: Tensor
    keep: Tensor
    raw: Tensor
    truncated: Tensor
    rejected: Tensor


def importance_weights(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    tis_cap: float | None = None,
    mis_level: Literal["none", "token", "sequence"] = "none",
    mis_low: float = 0.5,
    mis_high: float = 2.0,
    *,
    tis_level: Literal["token", "sequence"] = "token",
    tis_cap_low: float | None = None,
    batch_normalize: bool = False,
    rejection: Sequence[tuple[str, float | None, float]] = (),
) -> ImportanceWeights:
    """Off-policy correction weights w = π_prox / π_behaviour.

    Decoupled PPO (Hilton et al. 2022, eq. 6) multiplies each token's clipped surrogate by w.
    Truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training") caps w at ``tis_cap`` (and from below at ``tis_cap_low``); at sequence level (verl's
    ``rollout_is: sequence``) the capped weight is the sequence's product exp(Σ_t log w_t), the unbiased
    sequence-level correction. Batch normalisation divides the capped weights by their mean over the valid
    tokens (sequence level: over the sequences), so they average 1.
    Masked IS rejects instead of truncating: token level (IcePop, Ling team 2025) drops tokens with
    w ∉ [mis_low, mis_high]; sequence level (Liu et al. 2025, "When speed kills stability") drops whole
    sequences whose geometric-mean ratio exp(mean_t log w_t) falls outside that range. ``rejection`` adds
    verl's divergence rules (:func:`rejection_keep`).

    Args:
        proximal_logprobs: log π_prox ``[B, T]`` (trainer, before the update).
        behaviour_logprobs: log μ ``[B, T]`` (rollout engine, possibly stale).
        mask: Valid tokens ``[B, T]``.
        tis_cap: Upper truncation, or None.
        mis_level: ``none``, ``token`` or ``sequence``.
        mis_low, mis_high: Acceptance range for masked IS.
        tis_level: ``token`` or ``sequence``: the level the weight is formed and capped at.
        tis_cap_low: Lower truncation, or None.
        batch_normalize: Normalise the capped weights to mean 1 over the batch.
        rejection: ``(option, lower, upper)`` rules (:attr:`~relax_core.AlgorithmConfig.rollout_rs_rules`).
    """
    with torch.no_grad():
        mask_b = mask.bool()
        log_w = torch.where(mask_b, proximal_logprobs - behaviour_logprobs, torch.zeros_like(proximal_logprobs))
        if tis_level == "token":
            raw = clamped_ratio(log_w)  # [B, T]
        elif tis_level == "sequence":
            raw = clamped_ratio(log_w.sum(-1, keepdim=True)).expand_as(log_w)  # [B, T], constant along T
        else:
            raise ValueError(f"unknown tis_level {tis_level!r}; allowed: token, sequence")
        weights = torch.clamp(raw, min=tis_cap_low, max=tis_cap) if tis_cap or tis_cap_low else raw
        truncated = mask_b & (weights != raw)
        if batch_normalize:
            units = mask_b if tis_level == "token" else mask_b.any(-1)  # tokens [B, T], or sequences [B]
            values = weights if tis_level == "token" else weights[:, 0]
            mean = masked_mean(values, units)
            weights = weights / mean if float(mean) > 1e-8 else weights
        if mis_level == "token":
            token_ratio = clamped_ratio(log_w)
            keep = (token_ratio >= mis_low) & (token_ratio <= mis_high)
        elif mis_level == "sequence":
            seq_ratio = torch.exp(masked_mean(log_w, mask_b, dim=-1))  # [B]
            keep = ((seq_ratio >= mis_low) & (seq_ratio <= mis_high)).unsqueeze(-1).expand_as(mask_b)
        elif mis_level == "none":
            keep = torch.ones_like(mask_b)
        else:
            raise ValueError(f"unknown mis_level {mis_level!r}; allowed: none, token, sequence")
        passed = rejection_keep(log_w, mask_b, rejection) if rejection else torch.ones_like(mask_b)
    return ImportanceWeights(
        weights=weights, keep=keep & passed & mask_b, raw=raw, truncated=truncated, rejected=mask_b & ~passed
    )


def rejection_keep(log_w: Tensor, mask: Tensor, rules: Sequence[tuple[str, float | None, float]]) -> Tensor:
    """Tokens that pass every rejection rule (verl's ``rollout_rs``, "rollout correction"; every rule must pass).

    With log w = log π_prox − log π_behaviour per token, k1 = −log w, k2 = ½ (log w)², k3 = e^{log w} − 1 − log w
    (the KL estimators of Schulman 2020, with log w clamped to ±`LOG_RATIO_BOUND`):
    ``token_k1`` keeps log lower ≤ k1 ≤ log upper; ``token_k2``/``token_k3`` keep k ≤ upper; ``seq_sum_k*`` /
    ``seq_mean_k*`` / ``seq_max_k*`` apply the same bound to the sum / mean / max of k over the sequence's valid
    tokens and keep or drop the whole sequence.

    Args:
        log_w: log π_prox − log π_behaviour ``[B, T]``.
        mask: Valid tokens ``[B, T]``.
        rules: ``(option, lower, upper)`` triples.

    Returns:
        Bool ``[B, T]``: true where every rule passes (padding included; combine with the mask).
    """
    mask_b = mask.bool()
    log_w = torch.clamp(log_w, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    divergence = {"k1": -log_w, "k2": 0.5 * log_w**2, "k3": torch.exp(log_w) - 1.0 - log_w}  # [B, T] each
    keep = torch.ones_like(mask_b)
    for option, lower, upper in rules:
        level, _, estimator = option.rpartition("_")
        values = divergence[estimator]
        if level == "token":
            stat = values
        elif level == "seq_sum":
            stat = masked_sum(values, mask_b, dim=-1).unsqueeze(-1)  # [B, 1]
        elif level == "seq_mean":
            stat = masked_mean(values, mask_b, dim=-1).unsqueeze(-1)
        elif level == "seq_max":
            stat = torch.where(mask_b, values, -torch.inf).amax(-1, keepdim=True).clamp(min=0.0)
        else:
            raise ValueError(f"unknown rollout_rs option {option!r}")
        if estimator == "k1":
            assert lower is not None  # k1 rules carry both bounds
            passed = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            passed = stat <= upper
        keep = keep & passed.expand_as(mask_b)
    return keep
