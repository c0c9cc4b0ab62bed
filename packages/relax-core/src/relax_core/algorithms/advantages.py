"""Advantage estimators and return targets.

Token tensors are ``[B, T]`` over the response; ``mask`` marks the tokens the policy generated
(environment tokens of multi-turn rollouts and padding are 0). Recursions over time skip masked
positions: they carry the running value through, so an environment turn in the middle of a
response neither receives nor breaks credit assignment. Outcome (sequence) scores are ``[B]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from relax_core.algorithms.masked import masked_whiten

__all__ = [
    "VTraceOutput",
    "broadcast_to_tokens",
    "discounted_returns",
    "dynamic_sampling_keep",
    "gae_advantages",
    "gpg_advantages",
    "group_index",
    "grpo_advantages",
    "grpo_passk_advantages",
    "opo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "vtrace",
]


def group_index(group_ids: Sequence[Any] | Tensor) -> Tensor:
    """Map arbitrary group ids (strings, ints) to dense indices ``[B]`` in 0..G−1 (first-seen order)."""
    if isinstance(group_ids, Tensor):
        inverse: Tensor = torch.unique(group_ids, return_inverse=True)[1]
        return inverse
    seen: dict[Any, int] = {}
    return torch.tensor([seen.setdefault(g, len(seen)) for g in group_ids], dtype=torch.long)


def _group_stats(scores: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group count, group mean and unbiased group std, each ``[B]``."""
    n_groups = int(index.max().item()) + 1 if index.numel() else 0
    index = index.to(scores.device)
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, index, torch.ones_like(scores)
    )
    total = torch.zeros_like(count).index_add_(0, index, scores)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, index, (scores - mean[index]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return count[index], mean[index], std[index]


def grpo_advantages(
    scores: Tensor, group_ids: Sequence[Any] | Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath §4.1.2): Â_i = (r_i − mean_g) / (std_g + ε).

    Args:
        scores: Sequence rewards ``[B]``.
        group_ids: Group of each sample (samples of one prompt share an id).
        norm_by_std: Divide by the unbiased group std; False is Dr.GRPO (Liu et al. 2025).
        eps: Added to the std.

    Returns:
        Advantages ``[B]``; a group of one sample gets 0 (no baseline to compare against).
    """
    count, mean, std = _group_stats(scores, group_index(group_ids))
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def rloo_advantages(scores: Tensor, group_ids: Sequence[Any] | Tensor) -> Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): Â_i = r_i − mean_{j≠i} r_j.

    Returns:
        Advantages ``[B]``; 0 for groups of one.
    """
    count, mean, _ = _group_stats(scores, group_index(group_ids))
    loo_mean = (mean * count - scores) / (count - 1).clamp(min=1)
    return torch.where(count > 1, scores - loo_mean, torch.zeros_like(scores))


def opo_advantages(scores: Tensor, group_ids: Sequence[Any] | Tensor, lengths: Tensor) -> Tensor:
    """OPO (Hao et al. 2025, "On-policy RL with optimal reward baseline", arXiv 2505.23585): the group baseline
    weighs each reward by its response length, b_g = Σ_j L_j r_j / Σ_j L_j, and Â_i = r_i − b_g.

    Args:
        scores: Sequence rewards ``[B]``.
        group_ids: Group of each sample.
        lengths: Response lengths L_i ``[B]`` (valid tokens).

    Returns:
        Advantages ``[B]``; a group of one sample gets 0 (verl gives it its raw reward: a baseline of 0).
    """
    index = group_index(group_ids).to(scores.device)
    count, _, _ = _group_stats(scores, index)
    lengths = lengths.to(scores.dtype)
    n_groups = int(index.max().item()) + 1 if index.numel() else 0
    weighted = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, lengths * scores)
    total = torch.zeros_like(weighted).index_add_(0, index, lengths)
    baseline = (weighted / total.clamp(min=1))[index]  # [B]
    return torch.where(count > 1, scores - baseline, torch.zeros_like(scores))


def grpo_passk_advantages(
    scores: Tensor, group_ids: Sequence[Any] | Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Pass@k advantages, as verl's ``grpo_passk`` (which cites arXiv 2503.19595): only the best sample of each
    group is credited, with the margin r_max − r_second over the group's runner-up; every other sample gets 0.

    Args:
        scores: Sequence rewards ``[B]``.
        group_ids: Group of each sample.
        norm_by_std: Divide the margin by the group's unbiased std (+ ``eps``), as GRPO does.
        eps: Added to the std.

    Returns:
        Advantages ``[B]``; the first sample holding a group's maximum is its best; a group of one gets 0 (verl
        raises).
    """
    index = group_index(group_ids).to(scores.device)
    count, _, std = _group_stats(scores, index)
    adv = torch.zeros_like(scores)
    for g in range(int(index.max().item()) + 1 if index.numel() else 0):
        members = (index == g).nonzero().squeeze(-1)  # [n_g]
        if members.numel() < 2:
            continue
        values = scores[members]
        ranked = torch.sort(values, descending=True, stable=True)
        best = members[ranked.indices[0]]
        margin = ranked.values[0] - ranked.values[1]
        adv[best] = margin / (std[best] + eps) if norm_by_std else margin
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def gpg_advantages(scores: Tensor, group_ids: Sequence[Any] | Tensor, f_norm: float = 1.0) -> Tensor:
    """GPG group advantages (Chu et al. 2025, "GPG: a simple and strong reinforcement learning baseline for model
    reasoning"): Â_i = α (r_i − mean_g) / F_norm with α = B / M, M the number of samples of the batch with a
    non-zero reward (as verl counts it), which scales the batch's gradient back up for the samples that carry none.

    Args:
        scores: Sequence rewards ``[B]``.
        group_ids: Group of each sample.
        f_norm: F_norm (1 in the paper's default).

    Returns:
        Advantages ``[B]``; a group of one sample gets 0 (verl gives it α r_i / F_norm: a baseline of 0).
    """
    count, mean, _ = _group_stats(scores, group_index(group_ids))
    alpha = scores.numel() / max(int(torch.count_nonzero(scores)), 1)
    adv = alpha * (scores - mean) / f_norm
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def remax_advantages(token_rewards: Tensor, baseline_scores: Tensor, mask: Tensor) -> Tensor:
    """ReMax (Li et al. 2024, "ReMax: a simple, effective, and efficient reinforcement learning method for aligning
    large language models", Algorithm 1): the baseline is the reward of a greedy response to the same prompt,
    Â_t = Σ_{k≥t} r_k − b with b = r(greedy) (undiscounted reward-to-go, as verl).

    Args:
        token_rewards: Token rewards ``[B, T]`` (the score on the last valid token, plus any reward-placed penalty).
        baseline_scores: The greedy response's reward for each sample's prompt ``[B]``.
        mask: Valid tokens ``[B, T]``.

    Returns:
        Advantages ``[B, T]``, 0 on masked tokens.
    """
    returns = discounted_returns(token_rewards, mask, 1.0)  # [B, T]
    return torch.where(
        mask.bool(), returns - baseline_scores.to(returns.dtype).unsqueeze(-1), torch.zeros_like(returns)
    )


def broadcast_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """Spread per-sequence values ``[B]`` over the valid tokens of ``mask`` ``[B, T]`` (0 elsewhere)."""
    expanded = seq_values.unsqueeze(-1).expand(mask.shape)  # [B, T]
    return torch.where(mask.bool(), expanded, torch.zeros((), dtype=seq_values.dtype, device=seq_values.device))


def dynamic_sampling_keep(scores: Tensor, group_ids: Sequence[Any] | Tensor, tol: float = 0.0) -> Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, eq. 11): keep groups whose rewards are not all equal.

    Returns:
        Bool ``[B]``: true for samples of groups with reward spread (max − min) > ``tol``.
    """
    index = group_index(group_ids).to(scores.device)
    n_groups = int(index.max().item()) + 1 if index.numel() else 0
    high = torch.full((n_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    low = torch.full((n_groups,), torch.inf, dtype=scores.dtype, device=scores.device)
    high = high.scatter_reduce(0, index, scores, reduce="amax")
    low = low.scatter_reduce(0, index, scores, reduce="amin")
    return (high - low)[index] > tol


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Reward-to-go G_t = Σ_{k≥t} γ^{k−t} r_k over valid tokens ``[B, T]`` (masked tokens skipped, → 0)."""
    mask_b = mask.bool()
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[-1])):
        valid = mask_b[:, t]
        running = torch.where(valid, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, torch.zeros_like(running))
    return returns


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    last_values: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eqs. 11–16).

    δ_t = r_t + γ V_{t+1} − V_t,  Â_t = Σ_l (γλ)^l δ_{t+l},  return target R_t = Â_t + V_t.

    Args:
        rewards: Token rewards ``[B, T]`` (outcome reward on the last token, KL penalties, ...).
        values: Critic values ``[B, T]``.
        mask: Valid (policy-generated) tokens ``[B, T]``.
        gamma: Discount γ.
        lam: GAE λ; λ = 1 gives Monte-Carlo returns minus values.
        last_values: Value ``[B]`` bootstrapped after the last token (truncated episodes); None: terminal.

    Returns:
        ``(advantages, returns)``, each ``[B, T]`` and 0 on masked tokens.
    """
    mask_b = mask.bool()
    values = values.detach()
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0]) if last_values is None else last_values.to(rewards.dtype)  # [B]
    running = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[-1])):
        valid = mask_b[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # Masked positions carry the running estimate and the next value through unchanged.
        running = torch.where(valid, delta + gamma * lam * running, running)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = torch.where(valid, running, torch.zeros_like(running))
    returns = torch.where(mask_b, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


@dataclass(frozen=True)
class VTraceOutput:
    """Result of :func:`vtrace`.

    Attributes:
        targets: V-trace value targets v_s ``[B, T]`` (critic regression targets).
        advantages: Policy-gradient advantages r_s + γ v_{s+1} − V(x_s) ``[B, T]``, without the ρ_s
            factor (the policy loss applies its own importance weight).
        rhos: Truncated importance weights ρ_s = min(ρ̄, π/μ) ``[B, T]``.
    """

    targets: Tensor
    advantages: Tensor
    rhos: Tensor


def vtrace(
    rewards: Tensor,
    values: Tensor,
    target_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    last_values: Tensor | None = None,
) -> VTraceOutput:
    """V-trace off-policy value targets (Espeholt et al. 2018, IMPALA eq. 1 and §4.2).

    v_s − V_s = δ_s + γ c_s (v_{s+1} − V_{s+1}),  δ_s = ρ_s (r_s + γ V_{s+1} − V_s),
    ρ_s = min(ρ̄, π/μ), c_s = λ · min(c̄, π/μ). With π = μ and λ = 1, v_s is the discounted return.

    Args:
        rewards, values, mask: ``[B, T]`` as in :func:`gae_advantages`.
        target_logprobs: log π of the taken tokens under the policy being trained ``[B, T]``.
        behaviour_logprobs: log μ under the policy that generated them ``[B, T]``.
        gamma, lam: Discount and trace λ.
        rho_bar, c_bar: Truncation levels ρ̄ and c̄.
        last_values: Bootstrap value ``[B]`` after the last token; None: terminal.
    """
    with torch.no_grad():
        mask_b = mask.bool()
        log_rho = torch.where(mask_b, target_logprobs - behaviour_logprobs, torch.zeros_like(rewards))
        ratio = torch.exp(log_rho)  # [B, T]
        rhos = torch.clamp(ratio, max=rho_bar)
        cs = lam * torch.clamp(ratio, max=c_bar)
        targets = torch.zeros_like(rewards)
        advantages = torch.zeros_like(rewards)
        next_value = torch.zeros_like(rewards[:, 0]) if last_values is None else last_values.to(rewards.dtype)
        next_target = next_value.clone()  # v_{s+1}
        correction = torch.zeros_like(rewards[:, 0])  # v_{s+1} − V_{s+1}
        for t in reversed(range(rewards.shape[-1])):
            valid = mask_b[:, t]
            delta = rhos[:, t] * (rewards[:, t] + gamma * next_value - values[:, t])
            new_corr = delta + gamma * cs[:, t] * correction
            adv_t = rewards[:, t] + gamma * next_target - values[:, t]
            target_t = values[:, t] + new_corr
            correction = torch.where(valid, new_corr, correction)
            next_value = torch.where(valid, values[:, t], next_value)
            next_target = torch.where(valid, target_t, next_target)
            targets[:, t] = torch.where(valid, target_t, torch.zeros_like(target_t))
            advantages[:, t] = torch.where(valid, adv_t, torch.zeros_like(adv_t))
        rhos = torch.where(mask_b, rhos, torch.zeros_like(rhos))
    return VTraceOutput(targets=targets, advantages=advantages, rhos=rhos)


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ (Hu 2025, §3): discounted token returns whitened over the whole batch.

    Args:
        rewards: Token rewards ``[B, T]``, usually the outcome reward on the last token minus a
            per-token KL penalty (see :func:`~relax_core.kl_penalised_rewards`).
        mask: Valid tokens ``[B, T]``.
        gamma: Discount γ.

    Returns:
        Advantages ``[B, T]``, zero-mean unit-variance over valid tokens, 0 elsewhere.
    """
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask)


def reinforce_pp_baseline_advantages(
    scores: Tensor, group_ids: Sequence[Any] | Tensor, mask: Tensor, token_penalty: Tensor | None = None
) -> Tensor:
    """REINFORCE++-baseline (Hu 2025): subtract the group mean reward, then whiten over the batch.

    Args:
        scores: Sequence rewards ``[B]``.
        group_ids: Group of each sample.
        mask: Valid tokens ``[B, T]``.
        token_penalty: Optional per-token rewards ``[B, T]`` (e.g. −β·KL) whose reward-to-go is added
            before whitening.

    Returns:
        Advantages ``[B, T]``, whitened over valid tokens.
    """
    _, mean, _ = _group_stats(scores, group_index(group_ids))
    adv = broadcast_to_tokens(scores - mean, mask)  # [B, T]
    if token_penalty is not None:
        adv = adv + discounted_returns(token_penalty, mask)
    return masked_whiten(adv, mask)
