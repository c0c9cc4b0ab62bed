"""The algorithm table: one entry per advantage estimator, from which everything else is derived.

Config validation (allowed estimators and presets, group-size and on-policy checks), the presets, the
dispatch of :func:`~relax_core.compute_advantages`, the services a pipeline needs (critic, reference) and
the trainer's special cases (log-probs needed before the update) all read :data:`ALGORITHMS`.

A new estimator is one entry here plus its pure function in ``advantages.py``. The table is a plain dict:
code that wants a private estimator (a test, a research fork) adds an entry to it before building configs,
e.g. ``ALGORITHMS["toy"] = AlgorithmSpec(advantage=my_fn)``; nothing caches the set of names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from relax_core.config.components import AlgorithmConfig

# The table is read when a config is validated, which must not import torch (config errors come before any heavy
# import); the adapters import the torch math when an estimate is computed.

__all__ = [
    "ALGORITHMS",
    "AdvantageFn",
    "AlgorithmSpec",
    "EstimatorInputs",
    "algorithm_spec",
    "estimator_names",
    "off_policy_alternatives",
    "preset_names",
]


@dataclass(frozen=True)
class EstimatorInputs:
    """What :func:`~relax_core.compute_advantages` hands to an estimator's advantage function.

    Attributes:
        scores: Outcome rewards ``[B]`` (before any KL penalty).
        mask: Loss mask ``[B, T]``.
        token_rewards: ``[B, T]`` the score on each sequence's last valid token, plus ``penalty``.
        penalty: ``[B, T]`` the per-token −β·KL penalty when the KL term is placed in the reward, else 0.
        group_ids: Group of each sample (present when the spec ``needs_groups``).
        values: Critic values ``[B, T]`` (present when the spec ``needs_critic``).
        old_logprobs: Behaviour log-probs ``[B, T]`` (present when the spec ``needs_behaviour_logprobs``).
        proximal_logprobs: The trainer's log-probs before the update ``[B, T]``, when given.
        reward_baselines: The reward of a greedy response to each sample's prompt ``[B]`` (present when the spec
            ``needs_greedy_baseline``).
    """

    scores: Tensor
    mask: Tensor
    token_rewards: Tensor
    penalty: Tensor
    group_ids: Sequence[Any] | Tensor | None = None
    values: Tensor | None = None
    old_logprobs: Tensor | None = None
    proximal_logprobs: Tensor | None = None
    reward_baselines: Tensor | None = None


AdvantageFn = Callable[["AlgorithmConfig", EstimatorInputs], "tuple[Tensor, Tensor | None]"]
"""``(cfg, inputs) -> (advantages [B, T], critic targets [B, T] or None)``."""


@dataclass(frozen=True)
class AlgorithmSpec:
    """One advantage estimator and what it needs.

    Attributes:
        advantage: The advantage function (an adapter from :class:`EstimatorInputs` to a pure function).
        summary: One line for docs and error messages (paper and equation where there is one).
        needs_groups: Samples come in groups of one prompt; ``algorithm.group_size`` must be >= 2.
        needs_critic: A value model scores samples (a Critic service, critic weights, a value engine).
        needs_reference: Reference log-probs are needed even with ``kl_coef == 0``.
        needs_behaviour_logprobs: The rollout's behaviour log-probs enter the estimate (importance weights).
        on_policy_only: The estimate assumes on-policy data: ``staleness.tau`` must be 0.
        needs_proximal_logprobs: The trainer must compute its own log-probs before the update (the estimate's
            target policy), not only during it.
        needs_greedy_baseline: Each prompt also needs a greedy response, scored by the reward but not trained on,
            whose reward is the baseline (ReMax).
        presets: Named hyper-parameter sets for this estimator (``algorithm.preset``); the policy loss and its
            clip ranges, aggregation and KL settings are among them. Each preset name is unique in the table.
    """

    advantage: AdvantageFn
    summary: str = ""
    needs_groups: bool = False
    needs_critic: bool = False
    needs_reference: bool = False
    needs_behaviour_logprobs: bool = False
    on_policy_only: bool = False
    needs_proximal_logprobs: bool = False
    needs_greedy_baseline: bool = False
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


# ---------------------------------------------------------------- adapters to the pure functions
def _seq_scores(inputs: EstimatorInputs) -> Tensor:
    """``[B]`` scores with the summed reward-placed KL penalty (outcome estimators see one number a sample)."""
    from relax_core.algorithms.masked import masked_sum

    return inputs.scores + masked_sum(inputs.penalty, inputs.mask, dim=-1)


def _groups(inputs: EstimatorInputs) -> Sequence[Any] | Tensor:
    assert inputs.group_ids is not None  # compute_advantages checks the spec's needs first
    return inputs.group_ids


def _values(inputs: EstimatorInputs) -> Tensor:
    assert inputs.values is not None  # compute_advantages checks the spec's needs first
    return inputs.values


def _grpo(cfg: AlgorithmConfig, inputs: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    from relax_core.algorithms.advantages import broadcast_to_tokens, grpo_advantages

    seq_adv = grpo_advantages(_seq_scores(inputs), _groups(inputs), cfg.norm_adv_by_std)  # [B]
    return broadcast_to_tokens(seq_adv, inputs.mask), None


def _rloo(cfg: AlgorithmConfig, inputs: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    from relax_core.algorithms.advantages import broadcast_to_tokens, rloo_advantages

    seq_adv = rloo_advantages(_seq_scores(inputs), _groups(inputs))  # [B]
    return broadcast_to_tokens(seq_adv, inputs.mask), None


def _opo(cfg: AlgorithmConfig, inputs: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    from relax_core.algorithms.advantages import broadcast_to_tokens, opo_advantages

    lengths = inputs.mask.bool().sum(-1)  # [B]
    seq_adv = opo_advantages(_seq_scores(inputs), _groups(inputs), lengths)  # [B]
    return broadcast_to_tokens(seq_adv, inputs.mask), None


def _grpo_passk(cfg: AlgorithmConfig, inputs: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    from relax_core.algorithms.advantages import broadcast_to_tokens, grpo_passk_advantages

    seq_adv = grpo_passk_advantages(_seq_scores(inputs), _groups(inputs), cfg.norm_adv_by_std)  # [B]
    return broadcast_to_tokens(seq_adv, inputs.mask), None


def _gpg(cfg: AlgorithmConfig, inputs: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    from relax_core.algorithms.advantages import broadcast_to_tokens, gpg_advantages

    seq_adv = gpg_advantages(_seq_scores(inputs), _groups(inputs))  # [B]
    return broadcast_to_tokens(seq_adv, inputs.mask), None


def _remax(cfg: AlgorithmConfig, inputs: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    from relax_core.algorithms.advantages import remax_advantages

    assert inputs.reward_baselines is not None  # compute_advantages checks the spec's needs first
    return remax_advantages(inputs.token_rewards, inputs.reward_baselines, inputs.mask), None


def _reinforce_pp(cfg: AlgorithmConfig, inputs: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    from relax_core.algorithms.advantages import reinforce_pp_advantages

    return reinforce_pp_advantages(inputs.token_rewards, inputs.mask, cfg.gamma), None


def _reinforce_pp_baseline(cfg: AlgorithmConfig, inputs: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    from relax_core.algorithms.advantages import reinforce_pp_baseline_advantages

    return reinforce_pp_baseline_advantages(inputs.scores, _groups(inputs), inputs.mask, inputs.penalty), None


def _gae(cfg: AlgorithmConfig, inputs: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    from relax_core.algorithms.advantages import gae_advantages

    advantages, returns = gae_advantages(inputs.token_rewards, _values(inputs), inputs.mask, cfg.gamma, cfg.lam)
    return advantages, returns


def _vtrace(cfg: AlgorithmConfig, inputs: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    from relax_core.algorithms.advantages import vtrace

    behaviour = inputs.old_logprobs
    assert behaviour is not None  # compute_advantages checks the spec's needs first
    target = inputs.proximal_logprobs if inputs.proximal_logprobs is not None else behaviour
    out = vtrace(
        inputs.token_rewards,
        _values(inputs),
        target,
        behaviour,
        inputs.mask,
        cfg.gamma,
        cfg.lam,
        cfg.vtrace_rho_bar,
        cfg.vtrace_c_bar,
    )
    return out.advantages, out.targets


_PPO_CLIP = {"policy_loss": "ppo", "clip_eps_low": 0.2, "clip_eps_high": 0.2}

ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(
        advantage=_grpo,
        summary="group-normalised outcome advantages (Shao et al. 2024, DeepSeekMath, eq. 4)",
        needs_groups=True,
        presets={
            # GRPO: PPO clip, k3 KL in the loss.
            "grpo": {
                "norm_adv_by_std": True,
                "group_size": 8,
                **_PPO_CLIP,
                "loss_agg_mode": "seq-mean-token-mean",
                "kl_coef": 0.001,
                "kl_estimator": "k3",
                "kl_placement": "loss",
            },
            # Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): no std normalisation, no length
            # normalisation (token sums divided by a constant), no KL.
            "dr_grpo": {
                "norm_adv_by_std": False,
                "group_size": 8,
                **_PPO_CLIP,
                "loss_agg_mode": "seq-mean-token-sum-norm",
                "kl_coef": 0.0,
            },
            # DAPO (Yu et al. 2025): clip-higher, token-level loss, dynamic-sampling filter, no KL.
            "dapo": {
                "norm_adv_by_std": True,
                "group_size": 16,
                "policy_loss": "ppo",
                "clip_eps_low": 0.2,
                "clip_eps_high": 0.28,
                "loss_agg_mode": "token-mean",
                "kl_coef": 0.0,
                "filter_groups": True,
            },
            # GSPO (Zheng et al. 2025): sequence-level length-normalised ratios with a tight clip range.
            "gspo": {
                "norm_adv_by_std": True,
                "group_size": 8,
                "policy_loss": "gspo",
                "clip_eps_low": 0.0003,
                "clip_eps_high": 0.0004,
                "loss_agg_mode": "seq-mean-token-mean",
                "kl_coef": 0.0,
            },
        },
    ),
    "rloo": AlgorithmSpec(
        advantage=_rloo,
        summary="leave-one-out baseline (Ahmadian et al. 2024)",
        needs_groups=True,
        presets={
            # RLOO with the KL as a reward penalty.
            "rloo": {
                "group_size": 4,
                **_PPO_CLIP,
                "loss_agg_mode": "seq-mean-token-mean",
                "kl_coef": 0.001,
                "kl_estimator": "k1",
                "kl_placement": "reward",
            },
        },
    ),
    "reinforce_pp": AlgorithmSpec(
        advantage=_reinforce_pp,
        summary="discounted token returns, globally whitened (Hu 2025, REINFORCE++)",
        presets={
            # REINFORCE++ with the KL penalty in the reward.
            "reinforce_pp": {
                "group_size": 1,
                "gamma": 1.0,
                **_PPO_CLIP,
                "loss_agg_mode": "token-mean",
                "kl_coef": 0.001,
                "kl_estimator": "k2",
                "kl_placement": "reward",
            },
        },
    ),
    "reinforce_pp_baseline": AlgorithmSpec(
        advantage=_reinforce_pp_baseline,
        summary="REINFORCE++ with the group-mean baseline (Hu 2025)",
        needs_groups=True,
    ),
    "opo": AlgorithmSpec(
        advantage=_opo,
        summary="length-weighted group baseline (Hao et al. 2025, OPO)",
        needs_groups=True,
    ),
    "grpo_passk": AlgorithmSpec(
        advantage=_grpo_passk,
        summary="Pass@k: the best of each group gets its margin over the runner-up (verl's grpo_passk)",
        needs_groups=True,
    ),
    "gpg": AlgorithmSpec(
        advantage=_gpg,
        summary="group-centred rewards scaled by B / non-zero rewards (Chu et al. 2025, GPG)",
        needs_groups=True,
        presets={
            # GPG: its advantages with the plain −A·log π loss, no clip, no KL.
            "gpg": {"group_size": 8, "policy_loss": "gpg", "loss_agg_mode": "token-mean", "kl_coef": 0.0},
        },
    ),
    "remax": AlgorithmSpec(
        advantage=_remax,
        summary="reward-to-go minus a greedy response's reward (Li et al. 2024, ReMax)",
        needs_greedy_baseline=True,
    ),
    "gae": AlgorithmSpec(
        advantage=_gae,
        summary="generalised advantage estimation with a critic (Schulman et al. 2016, eq. 16)",
        needs_critic=True,
        on_policy_only=True,
        presets={
            # PPO with a critic (Ouyang et al. 2022 style RLHF): GAE, clipped value loss, KL as a reward penalty.
            "ppo": {
                "gamma": 1.0,
                "lam": 0.95,
                "whiten_advantages": True,
                "group_size": 1,
                **_PPO_CLIP,
                "loss_agg_mode": "token-mean",
                "kl_coef": 0.001,
                "kl_estimator": "k1",
                "kl_placement": "reward",
                "value_loss_coef": 0.5,
                "value_clip_eps": 0.2,
            },
        },
    ),
    "vtrace": AlgorithmSpec(
        advantage=_vtrace,
        summary="V-trace off-policy corrected targets with a critic (Espeholt et al. 2018, eq. 1)",
        needs_critic=True,
        needs_behaviour_logprobs=True,
        needs_proximal_logprobs=True,
    ),
}
"""Advantage estimator id → its spec (``algorithm.advantage_estimator`` takes these ids)."""


def estimator_names() -> tuple[str, ...]:
    """The ids ``algorithm.advantage_estimator`` accepts, in table order."""
    return tuple(ALGORITHMS)


def preset_names() -> tuple[str, ...]:
    """The names ``algorithm.preset`` accepts, in table order."""
    return tuple(name for spec in ALGORITHMS.values() for name in spec.presets)


def algorithm_spec(estimator: str) -> AlgorithmSpec:
    """The spec of ``estimator``.

    Raises:
        KeyError: If the estimator is not in :data:`ALGORITHMS` (the message lists the known ones).
    """
    spec = ALGORITHMS.get(estimator)
    if spec is None:
        raise KeyError(f"unknown advantage estimator {estimator!r}; known: {', '.join(ALGORITHMS)}")
    return spec


def off_policy_alternatives(estimator: str) -> str:
    """The estimators with the same needs (groups, critic) that accept stale data, joined by ``" or "``: what
    a config error suggests in place of an ``on_policy_only`` estimator with ``staleness.tau > 0``."""
    spec = algorithm_spec(estimator)
    names = [
        name
        for name, other in ALGORITHMS.items()
        if not other.on_policy_only
        and (other.needs_critic, other.needs_groups) == (spec.needs_critic, spec.needs_groups)
    ]
    return " or ".join(names) if names else "(none in the algorithm table)"
