"""Names the configs validate against, kept free of torch so that a config loads without importing it.

A config error must be reported before any heavy import; the math modules that use these names
(`algorithms/kl.py`, `algorithms/masked.py`) import them from here, and so do the configs (`config/components.py`).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["KLEstimator", "LossAggMode"]

KLEstimator = Literal["k1", "k2", "k3", "full"]
"""``k1``/``k2``/``k3``: per-token estimates from the sampled tokens (:func:`kl_estimate`); ``full``: the exact
KL(π_ref ‖ π_θ) over the vocabulary from both distributions (:func:`kl_full`)."""

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
"""How a ``[B, T]`` per-token loss is reduced to a scalar (see :func:`aggregate_loss`)."""
