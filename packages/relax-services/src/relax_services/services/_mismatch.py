"""The rollout/trainer mismatch per update: how far the rollout engine's behaviour log-probs are from the
trainer's own recomputation on the same weights.

Tokens sampled by the weights the trainer holds before an update (token version == trainer version) have two
log-probs of one distribution: the rollout engine's (vLLM's kernels, or the transformers engine's cached decode)
and the trainer's forward. Their k3 estimate of KL(μ ‖ π) on samples of μ, ``exp(w) − 1 − w`` with
``w = log π − log μ``, is 0 when the engines agree and measures numerical mismatch only: tokens from older
versions are left out, so staleness does not count (relax-core's ``mismatch_kl`` of decoupled PPO compares against
the proximal policy and includes it).

The loss function computes it per micro-batch without grad, where the trainer's pre-update log-probs are at
hand: the ``proximal_logprobs`` field when they were computed up front, else the forward's own log-probs when the
update is one optimizer step (with several steps and no up-front pass, later micro-batches run on updated weights,
so nothing is reported). The two numbers it returns are sums divided by the same unit the engine weights the
loss's metrics with (tokens or samples), so their ratio, taken by :func:`pop_rollout_mismatch` after the
engine averaged them, is the mean over all counted tokens of the update (exact for one optimizer step).
"""

from __future__ import annotations

import torch

__all__ = ["CURRENT_VERSION_FIELD", "current_version_mask", "mismatch_sums", "pop_rollout_mismatch"]

CURRENT_VERSION_FIELD = "current_version"
"""Per-token training-sample field: 1 where the token was sampled by the trainer's pre-update weights."""

_K3, _COUNT = "rollout_mismatch_k3_per_unit", "rollout_mismatch_tokens_per_unit"
_LOG_RATIO_BOUND = 20.0  # as relax-core's losses: one far-off token cannot make the estimate inf


def current_version_mask(token_versions: list[int], version: int) -> torch.Tensor:
    """``[L]`` float: 1 where ``token_versions`` equals ``version``."""
    return (torch.tensor(token_versions, dtype=torch.long) == version).float()


@torch.no_grad()
def mismatch_sums(
    trainer_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    current: torch.Tensor,
    per_token: bool = True,
    units: float | None = None,
) -> dict[str, float]:
    """The micro-batch's k3 sum and token count over current-version tokens, each divided by the micro-batch's
    unit: ``units`` when given (the units of its :class:`~relax_services.engines.LossResult`, which the engine
    weights metrics by), else its token count when ``per_token``, else its sample count.

    Args:
        trainer_logprobs: ``[B, L]`` the trainer's log-probs before the update.
        behaviour_logprobs: ``[B, L]`` the rollout engine's.
        mask: ``[B, L]`` response tokens that count.
        current: ``[B, L]`` :data:`CURRENT_VERSION_FIELD`.
        per_token: The engine weights metrics by tokens (token-mean loss aggregation), else by samples.
        units: The loss's own units, which override ``per_token``. A micro-batch with 0 units (masked IS rejected
            all of it) has weight 0, so its tokens leave the estimate.
    """
    keep = mask.bool() & current.bool()
    # float64: engines that agree differ by ~1e-7 per token, where float32's exp(w) − 1 − w is rounding noise.
    diff = trainer_logprobs.double() - behaviour_logprobs.double()
    w = torch.where(keep, diff, 0.0).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    k3 = torch.where(keep, torch.exp(w) - 1.0 - w, 0.0)
    unit = units if units is not None else float(mask.sum()) if per_token else float(mask.shape[0])
    unit = max(unit, 1.0)
    return {_K3: float(k3.sum()) / unit, _COUNT: float(keep.sum()) / unit}


def pop_rollout_mismatch(metrics: dict[str, float]) -> None:
    """Replaces the engine-averaged sums of :func:`mismatch_sums` in ``metrics`` by ``rollout_mismatch_kl`` (the
    mean k3 over the update's current-version tokens); nothing when no token counted."""
    k3, count = metrics.pop(_K3, None), metrics.pop(_COUNT, None)
    if k3 is not None and count:
        metrics["rollout_mismatch_kl"] = k3 / count
