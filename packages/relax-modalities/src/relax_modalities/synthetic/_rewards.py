"""Verifiable rewards and chance levels of the synthetic tasks."""

from __future__ import annotations

from typing import Any, Protocol

from relax_modalities.synthetic._manifest import TaskItem


class RewardFn(Protocol):
    """``(response, ground_truth) -> reward``; the shape of relax-core's scalar ``RewardFn``."""

    def __call__(self, response: str, ground_truth: Any, /, **kwargs: Any) -> float: ...


def exact_match_reward(response: str, ground_truth: TaskItem | str, /, **kwargs: Any) -> float:
    """1.0 when the stripped response equals the answer (a `TaskItem`'s, or the string itself), else 0.0."""
    answer = ground_truth.answer if isinstance(ground_truth, TaskItem) else str(ground_truth)
    return 1.0 if response.strip() == answer else 0.0


REWARD_FNS: dict[str, RewardFn] = {
    "image": exact_match_reward,
    "audio": exact_match_reward,
    "video": exact_match_reward,
    "text": exact_match_reward,
    "audio_video": exact_match_reward,
}
"""Reward function of each synthetic task (an explicit registry)."""


def reward(response: str, item: TaskItem) -> float:
    """Reward of ``response`` for ``item`` using its task's function from `REWARD_FNS`.

    Raises:
        KeyError: for a task without a reward function.
    """
    try:
        fn = REWARD_FNS[item.task]
    except KeyError:
        raise KeyError(f"no reward function for task {item.task!r}; known: {sorted(REWARD_FNS)}") from None
    return fn(response, item)


def chance_level(item: TaskItem) -> float:
    """Expected reward of a uniform guess over the item's options (``1 / len(options)``)."""
    return 1.0 / len(item.options) if item.options else 0.0
