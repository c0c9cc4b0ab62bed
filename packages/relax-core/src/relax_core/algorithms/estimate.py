"""The trainer-facing advantage step: outcome scores (+ KL penalty, + critic) → advantages per config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from relax_core.algorithms.kl import kl_estimate
from relax_core.algorithms.masked import masked_whiten
from relax_core.algorithms.table import EstimatorInputs, algorithm_spec
from relax_core.config.components import AlgorithmConfig

__all__ = ["AdvantageOutput", "compute_advantages", "outcome_token_rewards"]


@dataclass(frozen=True)
class AdvantageOutput:
    """Result of :func:`compute_advantages`.

    Attributes:
        advantages: ``[B, T]``, 0 on masked tokens.
        returns: Critic regression targets ``[B, T]`` (gae, vtrace), else None.
        token_rewards: The token rewards used ``[B, T]`` (outcome on the last valid token, minus
            β·KL when the KL penalty is placed in the reward).
    """

    advantages: Tensor
    returns: Tensor | None
    token_rewards: Tensor


def outcome_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's score ``[B]`` on its last valid token: ``[B, T]`` (0 elsewhere)."""
    mask_b = mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask_b)  # [B, T]
    last = torch.where(mask_b, positions, -1).max(dim=-1).values  # [B]; −1 if no valid token
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    has = last >= 0
    rewards[has.nonzero(as_tuple=True)[0], last[has]] = scores[has]
    return rewards


def compute_advantages(
    cfg: AlgorithmConfig,
    scores: Tensor,
    mask: Tensor,
    *,
    group_ids: Sequence[Any] | Tensor | None = None,
    values: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    proximal_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    reward_baselines: Tensor | None = None,
) -> AdvantageOutput:
    """Advantages (and critic targets) for a batch, per ``cfg.advantage_estimator``.

    The estimator's entry in the algorithm table (:data:`~relax_core.ALGORITHMS`) says which inputs it needs
    and holds the function that computes it.

    With ``kl_placement == "reward"`` and ``kl_coef > 0`` the per-token penalty β·KL(π ‖ π_ref) is
    subtracted from the token rewards (token estimators) or its sum from the score (grpo, rloo).

    Args:
        cfg: Algorithm settings.
        scores: Outcome rewards ``[B]``.
        mask: Loss mask ``[B, T]``.
        group_ids: Group of each sample; required by estimators that ``needs_groups`` (grpo, rloo,
            reinforce_pp_baseline).
        values: Critic values ``[B, T]``; required by estimators that ``needs_critic`` (gae, vtrace).
        old_logprobs: Behaviour log-probs ``[B, T]``; required by vtrace (``needs_behaviour_logprobs``) and the
            reward KL penalty.
        proximal_logprobs: Trainer log-probs ``[B, T]``: the V-trace target policy (on-policy if None),
            and preferred over ``old_logprobs`` for the KL penalty.
        ref_logprobs: Reference log-probs ``[B, T]``; required by the reward KL penalty.
        reward_baselines: The reward of a greedy response to each sample's prompt ``[B]``; required by estimators
            that ``needs_greedy_baseline`` (remax).

    Raises:
        ValueError: If an input the estimator needs is missing.
    """
    estimator = cfg.advantage_estimator
    token_rewards = outcome_token_rewards(scores, mask)  # [B, T]
    penalty = torch.zeros_like(token_rewards)
    if cfg.kl_placement == "reward" and cfg.kl_coef > 0:
        policy_lp = proximal_logprobs if proximal_logprobs is not None else old_logprobs
        if policy_lp is None or ref_logprobs is None:
            raise ValueError("kl_placement='reward' needs ref_logprobs and old_logprobs (or proximal_logprobs)")
        with torch.no_grad():
            kl = kl_estimate(policy_lp, ref_logprobs, cfg.kl_estimator, cfg.kl_clamp)
            penalty = torch.where(mask.bool(), -cfg.kl_coef * kl, penalty)
    token_rewards = token_rewards + penalty

    spec = algorithm_spec(estimator)
    if spec.needs_groups and group_ids is None:
        raise ValueError(f"advantage_estimator={estimator!r} needs group_ids")
    if spec.needs_critic and values is None:
        raise ValueError(f"advantage_estimator={estimator!r} needs critic values")
    if spec.needs_behaviour_logprobs and old_logprobs is None:
        raise ValueError(f"advantage_estimator={estimator!r} needs old_logprobs (behaviour)")
    if spec.needs_greedy_baseline and reward_baselines is None:
        raise ValueError(f"advantage_estimator={estimator!r} needs reward_baselines (a greedy response's reward)")
    inputs = EstimatorInputs(
        scores=scores,
        mask=mask,
        token_rewards=token_rewards,
        penalty=penalty,
        group_ids=group_ids,
        values=values,
        old_logprobs=old_logprobs,
        proximal_logprobs=proximal_logprobs,
        reward_baselines=reward_baselines,
    )
    advantages, returns = spec.advantage(cfg, inputs)
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return AdvantageOutput(advantages=advantages.detach(), returns=returns, token_rewards=token_rewards)
