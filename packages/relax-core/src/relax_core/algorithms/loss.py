"""The trainer-facing policy loss: one call computes the whole objective of an AlgorithmConfig."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from relax_core.algorithms.kl import _clamp_full_kl, kl_estimate
from relax_core.algorithms.masked import aggregate_loss, aggregation_units, masked_mean
from relax_core.algorithms.policy_losses import (
    LOG_RATIO_BOUND,
    ImportanceWeights,
    cispo_loss,
    clip_cov_loss,
    dppo_loss,
    dro_loss,
    geo_mean_loss,
    gspo_log_ratio,
    importance_weights,
    kl_cov_loss,
    pg_loss,
    ppo_clip_loss,
    sapo_loss,
)
from relax_core.config.components import AlgorithmConfig

__all__ = ["POLICY_LOSSES", "Surrogate", "SurrogateInputs", "compute_policy_loss", "policy_loss_units"]


def _check_shapes(shape: torch.Size, **tensors: Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {tuple(shape)} like logprobs")


@dataclass(frozen=True)
class SurrogateInputs:
    """What a policy surrogate of :data:`POLICY_LOSSES` reads; every tensor ``[B, T]``, zero on padding.

    Attributes:
        logprobs: log π_θ, with gradient.
        anchor: log π_anchor (proximal when decoupled, else behaviour), detached.
        log_ratio: ``logprobs − anchor``, with gradient.
        advantages: Detached advantages.
        mask: Bool valid tokens.
    """

    logprobs: Tensor
    anchor: Tensor
    log_ratio: Tensor
    advantages: Tensor
    mask: Tensor


Surrogate = Callable[[AlgorithmConfig, SurrogateInputs], "tuple[Tensor, Tensor, Tensor | None]"]
"""``(cfg, inputs) -> (loss [B, T], clip-or-gate indicator [B, T], dual-clip indicator [B, T] or None)``."""


def _ppo(cfg: AlgorithmConfig, x: SurrogateInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    return ppo_clip_loss(x.log_ratio, x.advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c)


def _gspo(cfg: AlgorithmConfig, x: SurrogateInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    log_ratio = gspo_log_ratio(x.log_ratio, x.mask)
    return ppo_clip_loss(log_ratio, x.advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c)


def _cispo(cfg: AlgorithmConfig, x: SurrogateInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    loss, clipped = cispo_loss(x.log_ratio, x.advantages, cfg.clip_eps_low, cfg.clip_eps_high)
    return loss, clipped, None


def _sapo(cfg: AlgorithmConfig, x: SurrogateInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    loss, gated = sapo_loss(x.log_ratio, x.advantages, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    return loss, gated, None


def _pg(cfg: AlgorithmConfig, x: SurrogateInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    return pg_loss(x.logprobs, x.advantages), torch.zeros_like(x.mask), None


def _dro(cfg: AlgorithmConfig, x: SurrogateInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    return dro_loss(x.logprobs, x.log_ratio, x.advantages, cfg.dro_beta), torch.zeros_like(x.mask), None


def _geo_mean(cfg: AlgorithmConfig, x: SurrogateInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    loss, clipped = geo_mean_loss(x.log_ratio, x.advantages, x.mask, cfg.clip_eps_low, cfg.clip_eps_high)
    return loss, clipped, None


def _clip_cov(cfg: AlgorithmConfig, x: SurrogateInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    loss, cut = clip_cov_loss(
        x.log_ratio,
        x.logprobs,
        x.advantages,
        x.mask,
        cfg.clip_eps_low,
        cfg.clip_eps_high,
        cfg.clip_cov_ratio,
        cfg.clip_cov_lb,
        cfg.clip_cov_ub,
    )
    return loss, cut, None


def _kl_cov(cfg: AlgorithmConfig, x: SurrogateInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    loss, penalised = kl_cov_loss(x.log_ratio, x.logprobs, x.advantages, x.mask, cfg.kl_cov_ratio, cfg.ppo_kl_coef)
    return loss, penalised, None


def _dppo(divergence: Literal["tv", "kl"]) -> Surrogate:
    def surrogate(cfg: AlgorithmConfig, x: SurrogateInputs) -> tuple[Tensor, Tensor, Tensor | None]:
        loss, outside = dppo_loss(
            x.logprobs, x.anchor, x.advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dppo_ratio_cap, divergence
        )
        return loss, outside, None

    return surrogate


POLICY_LOSSES: dict[str, Surrogate] = {
    "ppo": _ppo,
    "gspo": _gspo,
    "cispo": _cispo,
    "sapo": _sapo,
    "gpg": _pg,
    "reinforce": _pg,
    "dro": _dro,
    "geo_mean": _geo_mean,
    "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
    "dppo_tv": _dppo("tv"),
    "dppo_kl": _dppo("kl"),
}
"""``algorithm.policy_loss`` → its per-token surrogate (the pure functions are in ``policy_losses.py``); the
names are verl's, ``ppo`` being verl's ``vanilla``."""


def _corrections(cfg: AlgorithmConfig, proximal: Tensor, behaviour: Tensor, mask: Tensor) -> ImportanceWeights:
    """The off-policy weights and masks ``cfg`` asks for (truncated IS, masked IS, batch normalisation, rejection)."""
    return importance_weights(
        proximal,
        behaviour,
        mask,
        cfg.tis_cap,
        cfg.mis_level,
        cfg.mis_low,
        cfg.mis_high,
        tis_level=cfg.tis_level,
        tis_cap_low=cfg.tis_cap_low,
        batch_normalize=cfg.tis_batch_normalize,
        rejection=cfg.rollout_rs_rules,
    )


def compute_policy_loss(
    cfg: AlgorithmConfig,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    proximal_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    full_kl: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The full policy objective of ``cfg``: surrogate × off-policy weights + β·KL − entropy bonus.

    The clip is taken around the proximal policy when ``cfg.decoupled`` (decoupled PPO, Hilton et
    al. 2022), else around ``old_logprobs``. Off-policy weights (TIS cap, masked IS) come from
    π_prox/π_behaviour. Tokens rejected by masked IS leave the loss mask and so the normaliser of
    every data-dependent aggregation (token-mean counts tokens; seq-mean-token-mean and
    seq-mean-token-sum count sequences with a kept token); seq-mean-token-sum-norm divides by the
    constant B · C by definition. Log-ratios are clamped to ±`LOG_RATIO_BOUND` (20) before ``exp``,
    so one token with a far-off behaviour log-prob cannot make the gradient NaN.

    Args:
        cfg: Algorithm settings (policy_loss, clip ranges, aggregation, KL, entropy, corrections).
        logprobs: log π_θ of the response tokens ``[B, T]``, with gradient.
        old_logprobs: Behaviour log-probs from the rollout engine ``[B, T]``.
        advantages: ``[B, T]``.
        mask: Loss mask ``[B, T]`` (1 on policy-generated tokens).
        proximal_logprobs: log π_prox ``[B, T]`` recomputed by the trainer; required iff ``cfg.decoupled``.
        ref_logprobs: Reference log-probs ``[B, T]``; required when ``kl_coef > 0`` and
            ``kl_placement == "loss"``; when given with placement "reward" only the diagnostic is reported.
        entropy: Per-token entropy ``[B, T]`` (with gradient); required when ``entropy_coef > 0``.
        full_kl: The exact KL(π_ref ‖ π_θ) over the vocabulary per token ``[B, T]``, unclamped and with gradient
            (:func:`~relax_core.algorithms.kl.kl_full` with ``clamp=None``, e.g. summed chunk by chunk where the
            policy's logits are); required with ``kl_estimator='full'`` (then ``ref_logprobs`` is not used).
            ``cfg.kl_clamp`` is applied here, as :func:`~relax_core.algorithms.kl.kl_full` applies it.

    Returns:
        ``(loss, diagnostics)``: the scalar to minimise and floats ``policy_loss``, ``clip_frac``,
        ``dual_clip_frac``, ``approx_kl``, ``ratio_mean``, and when present ``is_weight_mean/min/max``,
        ``is_truncated_frac``, ``is_masked_frac``, ``rs_masked_frac`` (valid tokens the ``rollout_rs`` rules
        rejected), ``rs_seq_masked_frac`` (sequences with a rejected token), ``mismatch_kl``, ``kl``,
        ``entropy``, ``loss``.

    Raises:
        ValueError: On shape mismatches or a missing input the config needs.
    """
    _check_shapes(
        logprobs.shape,
        old_logprobs=old_logprobs,
        advantages=advantages,
        mask=mask,
        proximal_logprobs=proximal_logprobs,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        full_kl=full_kl,
    )
    if cfg.decoupled and proximal_logprobs is None:
        raise ValueError("cfg.decoupled is true: proximal_logprobs (trainer log-probs before the update) are required")
    if not cfg.decoupled and proximal_logprobs is not None:
        raise ValueError("proximal_logprobs given but cfg.decoupled is false; set algorithm.decoupled=true to use them")
    exact_kl = cfg.uses_full_kl
    if exact_kl and full_kl is None:
        raise ValueError("kl_estimator='full' needs full_kl (the per-token KL over the vocabulary)")
    if cfg.kl_coef > 0 and cfg.kl_placement == "loss" and ref_logprobs is None and not exact_kl:
        raise ValueError("kl_coef > 0 with kl_placement='loss' needs ref_logprobs")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy tensor")

    mask_b = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # Padding may hold garbage (−inf log-probs); select it away so no NaN reaches values or gradients.
    logprobs = torch.where(mask_b, logprobs, zero)
    advantages = torch.where(mask_b, advantages, zero)
    anchor = proximal_logprobs if proximal_logprobs is not None else old_logprobs
    anchor_lp = torch.where(mask_b, anchor, zero).detach()  # [B, T]
    inputs = SurrogateInputs(logprobs, anchor_lp, logprobs - anchor_lp, advantages.detach(), mask_b)
    per_token, clipped, dual = POLICY_LOSSES[cfg.policy_loss](cfg, inputs)  # [B, T] each

    diagnostics: dict[str, float] = {}
    loss_mask = mask_b
    if proximal_logprobs is not None:
        iw = _corrections(cfg, proximal_logprobs, old_logprobs, mask_b)
        per_token = per_token * iw.weights
        loss_mask = iw.keep
        with torch.no_grad():
            log_w = torch.where(mask_b, proximal_logprobs - old_logprobs, zero).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
            diagnostics.update(
                is_weight_mean=float(masked_mean(iw.weights, mask_b).item()),
                is_weight_min=float(torch.where(mask_b, iw.raw, torch.inf).min().item()) if mask_b.any() else 1.0,
                is_weight_max=float(torch.where(mask_b, iw.raw, -torch.inf).max().item()) if mask_b.any() else 1.0,
                is_truncated_frac=float(masked_mean(iw.truncated.float(), mask_b).item()),
                is_masked_frac=float(masked_mean((~iw.keep).float(), mask_b).item()),
                rs_masked_frac=float(masked_mean(iw.rejected.float(), mask_b).item()),
                rs_seq_masked_frac=float(masked_mean(iw.rejected.any(-1).float(), mask_b.any(-1)).item()),
                # KL(μ ‖ π_prox) by k3 on samples of μ: the rollout/trainer mismatch.
                mismatch_kl=float(masked_mean(torch.exp(log_w) - 1.0 - log_w, mask_b).item()),
            )

    policy_loss = aggregate_loss(per_token, loss_mask, cfg.loss_agg_mode, cfg.loss_norm_constant)
    loss = policy_loss
    if exact_kl:
        assert full_kl is not None  # checked above
        kl = torch.where(mask_b, _clamp_full_kl(full_kl, cfg.kl_clamp), zero)  # [B, T]; padding may hold anything
        kl_value = aggregate_loss(kl, loss_mask, cfg.loss_agg_mode, cfg.loss_norm_constant)
        loss = loss + cfg.kl_coef * kl_value
        diagnostics["kl"] = float(kl_value.item())
    elif ref_logprobs is not None:
        kl = kl_estimate(logprobs, torch.where(mask_b, ref_logprobs, zero), cfg.kl_estimator, cfg.kl_clamp)
        kl_value = aggregate_loss(kl, loss_mask, cfg.loss_agg_mode, cfg.loss_norm_constant)
        if cfg.kl_placement == "loss" and cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_value
        diagnostics["kl"] = float(kl_value.item())
    if entropy is not None:
        entropy_value = aggregate_loss(
            torch.where(mask_b, entropy, zero), loss_mask, cfg.loss_agg_mode, cfg.loss_norm_constant
        )
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * entropy_value
        diagnostics["entropy"] = float(entropy_value.item())

    with torch.no_grad():
        # The clamped log-ratio the surrogates used, so one far-off token cannot make these inf.
        lr_det = inputs.log_ratio.detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        diagnostics.update(
            policy_loss=float(policy_loss.item()),
            clip_frac=float(masked_mean(clipped.float(), mask_b).item()),
            dual_clip_frac=float(masked_mean(dual.float(), mask_b).item()) if dual is not None else 0.0,
            # k3 estimate of KL(π_anchor ‖ π_θ), how far this update has moved the policy.
            approx_kl=float(masked_mean(torch.exp(lr_det) - 1.0 - lr_det, mask_b).item()),
            ratio_mean=float(masked_mean(torch.exp(lr_det), mask_b).item()),
            loss=float(loss.item()),
        )
    return loss, diagnostics


def policy_loss_units(
    cfg: AlgorithmConfig, old_logprobs: Tensor, mask: Tensor, proximal_logprobs: Tensor | None = None
) -> float:
    """The units :func:`compute_policy_loss` averages over (its loss mask, after masked IS, counted by
    :func:`~relax_core.aggregation_units`): the weight that combines the losses of a batch's parts exactly.

    Every term of the objective (surrogate, KL, entropy) is aggregated over the same loss mask, so one count
    serves the whole loss. The count depends on detached log-probs only and carries no gradient.

    Args:
        cfg: The algorithm (aggregation mode, masked-IS settings).
        old_logprobs: Behaviour log-probs ``[B, T]``.
        mask: Loss mask ``[B, T]``.
        proximal_logprobs: log π_prox ``[B, T]`` when the objective is decoupled (as passed to
            :func:`compute_policy_loss`), else None.
    """
    keep = mask.bool()
    if proximal_logprobs is not None:
        keep = _corrections(cfg, proximal_logprobs, old_logprobs, keep).keep
    return aggregation_units(keep, cfg.loss_agg_mode)
