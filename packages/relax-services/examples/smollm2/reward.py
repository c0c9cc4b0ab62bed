"""The SmolLM2 example's reward (``reward.fn=reward.py:score``): the sum, first and alone.

SmolLM2-135M-Instruct sampled at temperature 1 never answers with the bare number (0 of 256 samples over four
phrasings of the prompt), so an exact-match reward gives GRPO no signal; it does often open with the answer
(``The answer is 14.``), which earns half. The other half is the format: nothing but the number.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_FIRST_INTEGER = re.compile(r"-?\d+")


def score(response: str, ground_truth: str, metadata: Mapping[str, object]) -> float:
    """1.0 when the stripped response is exactly ``ground_truth``; 0.5 when the first integer in it is; else 0.0.

    ``37`` scores 1; ``The answer is 37.`` or ``37.`` 0.5; ``12 + 25 = 37`` 0 (its first number is 12).
    """
    text, truth = response.strip(), ground_truth.strip()
    if text == truth:
        return 1.0
    first = _FIRST_INTEGER.search(text)
    return 0.5 if first is not None and first.group() == truth else 0.0
