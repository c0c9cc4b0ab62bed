"""The SmolLM2 example's reward: the whole response must be the sum, digits only (``reward.fn=reward.py:score``)."""

from __future__ import annotations

from collections.abc import Mapping


def score(response: str, ground_truth: str, metadata: Mapping[str, object]) -> float:
    """1.0 when the response, stripped of surrounding whitespace, is exactly ``ground_truth``; else 0.0.

    ``37`` scores 1; ``3 + 4 = 7``, ``The answer is 37.`` or ``37.`` score 0: the task is the answer *and* the format.
    """
    return 1.0 if response.strip() == ground_truth.strip() else 0.0
