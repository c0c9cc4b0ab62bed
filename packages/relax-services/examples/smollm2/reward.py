"""The SmolLM2 example's reward (``reward.fn=reward.py:score``): 1 when the response's answer is the sum, else 0.

SmolLM2-135M-Instruct answers ``What is 4+18? Reply with only the number.`` mostly by restating the question
(``4 + 18 = 22``), sometimes in a sentence (``The answer is 22.``). The answer is therefore the first integer after
an optional leading restatement ``a + b``: scoring the first integer alone would read the restated ``4`` and
mark every such reply wrong (the first version of this example did, and its reward stayed near 0.1).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_INTEGER = re.compile(r"-?\d+")
_RESTATED = re.compile(r"^\s*-?\d+\s*\+\s*-?\d+")  # "4 + 18" opening "4 + 18 = 22"


def answer(response: str) -> str | None:
    """The integer the response gives as its answer: the first one after a leading ``a + b``; None if none.

    ``4 + 18 = 22`` gives ``22``; ``The answer is 22.`` ``22``; ``4 + 18 is 21, no, 22`` ``21``; ``four`` None.
    """
    numbers = _INTEGER.findall(_RESTATED.sub("", response, count=1))
    return numbers[0] if numbers else None


def score(response: str, ground_truth: str, metadata: Mapping[str, object]) -> float:
    """1.0 when :func:`answer` of the response is ``ground_truth`` (whitespace stripped), else 0.0."""
    return 1.0 if answer(response) == ground_truth.strip() else 0.0
