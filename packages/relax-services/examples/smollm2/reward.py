"""The SmolLM2 example's reward (``reward.fn=reward.py:score``): a ladder from the right sum to the right format.

SmolLM2-135M-Instruct sampled at temperature 1 never answers with the bare number (0 of 256 samples over four
phrasings of the prompt) and rarely opens with it, so exact match gives GRPO no signal (a run stayed at 0.0-0.08
for its first updates); it does often write the sum somewhere (``4 + 17 = 21``), which earns a quarter, opening with
it (``The answer is 21.``) half, and nothing but the number all of it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_INTEGER = re.compile(r"-?\d+")


def score(response: str, ground_truth: str, metadata: Mapping[str, object]) -> float:
    """1.0 for exactly ``ground_truth`` (whitespace stripped); 0.5 when the first integer of the response is the sum;
    0.25 when a later one is; else 0.0.

    ``37`` scores 1; ``The answer is 37.`` 0.5; ``12 + 25 = 37`` 0.25; ``12 + 25 = 36`` or ``370`` 0.
    """
    text, truth = response.strip(), ground_truth.strip()
    if text == truth:
        return 1.0
    numbers = _INTEGER.findall(text)
    if numbers and numbers[0] == truth:
        return 0.5
    return 0.25 if truth in numbers else 0.0
