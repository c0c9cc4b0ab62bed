"""Masked reductions and loss aggregation over [B, T] token tensors.

Masked positions never contribute a value or a gradient: every reduction selects with
``torch.where`` instead of multiplying, so NaN/inf in padding cannot leak into the result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_core._names import LossAggMode

__all__ = ["LossAggMode", "aggregate_loss", "masked_mean", "masked_sum", "masked_var", "masked_whiten"]


def _zeroed(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is true (over ``dim``, or everything)."""
    zeroed = _zeroed(values, mask)
    return zeroed.sum() if dim is None else zeroed.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is true; 0 where nothing is selected."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the selected entries (Bessel-corrected when ``unbiased`` and more than one)."""
    mean = masked_mean(values, mask)
    count = mask.bool().sum().to(values.dtype)
    sq = masked_sum((values - mean) ** 2, mask)
    denom = count - 1 if unbiased and count > 1 else count.clamp(min=1)
    return sq / denom


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise the selected entries to unit variance (and zero mean if ``shift_mean``); masked → 0.

    Args:
        values: Any shape, usually advantages ``[B, T]``.
        mask: Same shape; true where the entry counts.
        shift_mean: Subtract the masked mean (False keeps the mean, as REINFORCE++ does not).
        eps: Added to the variance before the square root.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _zeroed(whitened, mask)


def aggregate_loss(
    loss: Tensor, mask: Tensor, mode: LossAggMode = "token-mean", norm_constant: float | None = None
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    Modes:
        ``token-mean``: Σ_{b,t} m·ℓ / Σ m — every token weighs the same (DAPO, Yu et al. 2025, eq. 8).
        ``token-sum``: Σ_{b,t} m·ℓ — no normaliser at all (the loss and its gradient grow with the batch).
        ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (GRPO, Shao et al.
        2024, eq. 3). Sequences with no valid token are left out.
        ``seq-mean-token-sum``: mean over sequences of each sequence's token sum. Sequences with no valid
        token are left out (as in ``seq-mean-token-mean``), so a sequence rejected by masked IS does not
        shrink the loss and its gradient by kept / B.
        ``seq-mean-token-sum-norm``: Σ_{b,t} m·ℓ / (B · C) with a constant C (Dr.GRPO, Liu et al. 2025),
        C = ``norm_constant`` or the padded width T. A run config sets C to its generation budget
        ``rollout.max_new_tokens`` unless given, so C never moves with a batch's longest answer.
    """
    if mode == "token-mean":
        return masked_mean(loss, mask)
    if mode == "token-sum":
        return masked_sum(loss, mask)
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss, mask, dim=-1)  # [B]
        has_tokens = mask.bool().any(dim=-1)  # [B]
        return masked_mean(per_seq, has_tokens)
    if mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss, mask, dim=-1)  # [B]
        return masked_mean(per_seq, mask.bool().any(dim=-1))
    if mode == "seq-mean-token-sum-norm":
        constant = float(norm_constant) if norm_constant is not None else float(loss.shape[-1])
        return masked_sum(loss, mask) / (loss.shape[0] * constant)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed: {', '.join(_MODES)}")


def aggregation_units(mask: Tensor, mode: LossAggMode = "token-mean") -> float:
    """How many units :func:`aggregate_loss` averages over: its denominator up to the constant of
    ``seq-mean-token-sum-norm``.

    Splitting a batch into parts ``p`` gives ``aggregate_loss(batch) = Σ_p n_p · aggregate_loss(p) / Σ_p n_p``
    with ``n_p = aggregation_units(p)``, exactly, for every mean mode: kept tokens for ``token-mean``, sequences
    with a kept token for ``seq-mean-token-mean`` / ``seq-mean-token-sum``, all sequences for
    ``seq-mean-token-sum-norm`` (whose constant ``C`` is the same in every part when ``norm_constant`` is given).
    ``token-sum`` has no unit to average over: each part counts 1, so parts combine as the mean of their sums (the
    batch's sum divided by the number of parts; exact when a step is one micro-batch).
    This is what lets a training engine combine micro-batches exactly when masked importance sampling removes a
    different number of tokens or sequences from each.
    """
    mask_b = mask.bool()
    if mode == "token-mean":
        return float(mask_b.sum())
    if mode == "token-sum":
        return 1.0
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return float(mask_b.any(dim=-1).sum())
    if mode == "seq-mean-token-sum-norm":
        return float(mask.shape[0])
    raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed: {', '.join(_MODES)}")


_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
