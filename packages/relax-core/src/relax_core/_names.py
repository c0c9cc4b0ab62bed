"""Names the configs validate against, kept free of torch so that a config loads without importing it.

A config error must be reported before any heavy import; the math modules that use these names
(`algorithms/kl.py`, `algorithms/masked.py`) import them from here, and so do the configs (`config/components.py`).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["KLEstimator", "LossAggMode"]

KLEstimator = Literal["k1", "k2", "k3", "abs", "k1+", "k3+", "kl", "mse", "low_var_kl", "full"]
"""``k1``/``k2``/``k3``/``abs``: per-token estimates from the sampled tokens (:func:`kl_estimate`); ``k1+``/``k3+``:
the value of k1/k3 with the gradient of k2 (straight-through); ``kl``, ``mse`` and ``low_var_kl``: verl's names of
k1, k2 and k3; ``full``: the exact KL(π_ref ‖ π_θ) over the vocabulary from both distributions (:func:`kl_full`)."""

LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
"""How a ``[B, T]`` per-token loss is reduced to a scalar (see :func:`aggregate_loss`)."""
