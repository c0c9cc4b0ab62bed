"""The reward registry and the shapes of a reward function.

:data:`REWARD_REGISTRY` names the built-ins; :func:`resolve_reward_fn` turns a registry name or a dotted import
path into the callable (the reward runner's :func:`~relax_core.load_reward_fn` adds ``file.py:function``). The
protocols describe the three plain calling conventions; the runner reads the convention of each function from
its signature (:func:`~relax_core.call_style`), which also takes a ``metadata`` argument and verl's names.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from relax_core.rewards.basic import exact_match_reward, format_reward, math_reward, multiple_choice_reward
from relax_core.rewards.extras import length_penalty_reward, math_verify_reward, regex_reward, weighted_reward

__all__ = [
    "REWARD_REGISTRY",
    "AsyncRewardFn",
    "BatchedRewardFn",
    "RewardFn",
    "resolve_reward_fn",
]


class RewardFn(Protocol):
    """Scalar reward: one response and its ground truth → a float."""

    def __call__(self, response: str, ground_truth: Any, /, **kwargs: Any) -> float: ...


class BatchedRewardFn(Protocol):
    """Batched reward: parallel lists → one float per response (e.g. a reward model)."""

    def __call__(self, responses: Sequence[str], ground_truths: Sequence[Any], /, **kwargs: Any) -> Sequence[float]: ...


class AsyncRewardFn(Protocol):
    """Async reward: a coroutine per response (e.g. a sandbox or a remote judge)."""

    def __call__(self, response: str, ground_truth: Any, /, **kwargs: Any) -> Awaitable[float]: ...


REWARD_REGISTRY: dict[str, Callable[..., Any]] = {
    "exact_match": exact_match_reward,
    "multiple_choice": multiple_choice_reward,
    "math": math_reward,
    "format": format_reward,
    "math_verify": math_verify_reward,
    "regex": regex_reward,
    "length_penalty": length_penalty_reward,
    "weighted": weighted_reward,
}
"""Built-in reward functions by name (all scalar)."""


def resolve_reward_fn(name: str) -> Callable[..., Any]:
    """A registry name, or a dotted import path ``pkg.mod:fn`` / ``pkg.mod.fn``, to the callable.

    Raises:
        ValueError: If the name is neither registered nor importable (the message says which).
    """
    if name in REWARD_REGISTRY:
        return REWARD_REGISTRY[name]
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown reward {name!r}: not one of {', '.join(sorted(REWARD_REGISTRY))} and not a dotted path"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r}: {exc}") from exc
    fn: Callable[..., Any] | None = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"reward {name!r}: module {module_name!r} has no callable {attr!r}")
    return fn
