"""Chance levels of held-out rows: the expected reward of a uniform guess over a row's choices, where the reward
and the row allow computing it.

A row's choices are its ``extra_info["options"]`` (or ``["choices"]``) when it lists them; for the
``multiple_choice`` reward without such a list, the letters the prompt labels its options with (``A.``, ``B)``,
``(C)`` at the start of a line, from ``A`` on without a gap). The chance level is then the mean of the reward
itself over those choices (``1 / choices`` for a multiple-choice or exact-match check with one right choice). It
is unknown (NaN) for a user or remote reward (they are not called outside the reward service) and for a row
that lists no choices under a reward with no finite answer set (math, format, regex, ...).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from relax_core import REWARD_REGISTRY, RewardRunnerConfig
from relax_modalities import DataRecord

__all__ = ["ChanceLevels", "row_chance"]

_LABEL = re.compile(r"(?m)^\s*\(?([A-J])[).:]\s")


def _labelled_letters(record: DataRecord) -> list[str]:
    """The option letters the prompt labels, ``A`` first and without a gap (none when it labels fewer than 2)."""
    found = {m for message in record.messages for m in _LABEL.findall(message.text)}
    letters = []
    for letter in "ABCDEFGHIJ":
        if letter not in found:
            break
        letters.append(letter)
    return letters if len(letters) >= 2 else []


def _choices(record: DataRecord, fn: str) -> Sequence[str] | None:
    for key in ("options", "choices"):
        listed = record.extra_info.get(key)
        if isinstance(listed, list | tuple) and listed and all(isinstance(o, str) for o in listed):
            return list(listed)
    if fn == "multiple_choice":
        return _labelled_letters(record) or None
    return None


def row_chance(record: DataRecord, rewards: RewardRunnerConfig) -> tuple[float, str | None]:
    """``(chance level, None)`` of one held-out row under the reward its ``data_source`` is routed to, or
    ``(nan, why it is unknown)``."""
    spec = rewards.routes.get(record.data_source, rewards.default)
    if spec.fn not in REWARD_REGISTRY:
        return math.nan, f"reward {spec.fn!r} is a user or remote function (not called to estimate chance)"
    choices = _choices(record, spec.fn)
    if choices is None:
        return math.nan, f"rows list no choices (extra_info.options) for the {spec.fn!r} reward"
    fn = REWARD_REGISTRY[spec.fn]
    try:
        scores = [float(fn(choice, record.ground_truth, **spec.kwargs)) for choice in choices]
    except Exception as exc:  # a reward that cannot score a bare choice has no chance level here
        return math.nan, f"the {spec.fn!r} reward cannot score a bare choice ({type(exc).__name__})"
    return sum(scores) / len(scores), None


class ChanceLevels:
    """Per ``data_source``: the mean chance level of its held-out rows, NaN (with the first reason) when any row's
    is unknown."""

    def __init__(self, rewards: RewardRunnerConfig) -> None:
        self.rewards = rewards
        self._values: dict[str, list[float]] = {}
        self.unknown: dict[str, str] = {}

    def add(self, task: str, record: DataRecord) -> None:
        """Count one held-out row of ``task``."""
        value, why = row_chance(record, self.rewards)
        if why is not None:
            self.unknown.setdefault(task, why)
        self._values.setdefault(task, []).append(value)

    def levels(self) -> Mapping[str, float]:
        """``data_source`` → chance level (NaN: unknown, see :attr:`unknown`)."""
        return {t: math.nan if t in self.unknown else math.fsum(v) / len(v) for t, v in self._values.items()}
