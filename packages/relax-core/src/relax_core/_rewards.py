"""Reward function protocols, the registry, and fault-isolated scoring.

A reward function comes in one of three calling conventions (scalar, batched, async). The
:class:`RewardScorer` built by :func:`build_reward` calls it and turns every exception, bad return
value or timeout into a failed :class:`RewardResult` for that sample alone.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from relax_core._configs import RewardConfig
from relax_core._reward_builtins import length_penalty_reward, math_verify_reward, regex_reward, weighted_reward
from relax_core._reward_fns import exact_match_reward, format_reward, math_reward, multiple_choice_reward

__all__ = [
    "REWARD_REGISTRY",
    "AsyncRewardFn",
    "BatchedRewardFn",
    "RewardFn",
    "RewardResult",
    "RewardScorer",
    "build_reward",
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


@dataclass(frozen=True)
class RewardResult:
    """The score of one response.

    Attributes:
        reward: The reward; ``failure_reward`` of the config when scoring failed.
        error: Why scoring failed (exception type and message), None on success.
    """

    reward: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the reward function succeeded."""
        return self.error is None


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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _as_reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"reward function returned {type(value).__name__}, expected a float")
    if not math.isfinite(value):
        raise ValueError(f"reward function returned a non-finite value {value}")
    return float(value)


class RewardScorer:
    """Calls a reward function over a batch, isolating failures per sample.

    Args:
        fn: The reward function.
        kind: ``scalar``, ``batched`` or ``async`` (see the protocols).
        kwargs: Extra keyword arguments for every call.
        timeout_s: Per-response timeout of async functions.
        failure_reward: Reward recorded for failed samples.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        kind: Literal["scalar", "batched", "async"],
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        failure_reward: float = 0.0,
    ) -> None:
        self.fn = fn
        self.kind = kind
        self.kwargs = dict(kwargs or {})
        self.timeout_s = timeout_s
        self.failure_reward = failure_reward

    def _fail(self, exc: BaseException) -> RewardResult:
        return RewardResult(self.failure_reward, _describe(exc))

    def _score_one(self, response: str, ground_truth: Any) -> RewardResult:
        try:
            if self.kind == "batched":
                values = list(self.fn([response], [ground_truth], **self.kwargs))
                if len(values) != 1:
                    raise ValueError(f"batched reward returned {len(values)} values for 1 response")
                return RewardResult(_as_reward(values[0]))
            return RewardResult(_as_reward(self.fn(response, ground_truth, **self.kwargs)))
        except Exception as exc:
            return self._fail(exc)

    def _score_batched(self, responses: Sequence[str], ground_truths: Sequence[Any]) -> list[RewardResult]:
        try:
            values = list(self.fn(list(responses), list(ground_truths), **self.kwargs))
            if len(values) != len(responses):
                raise ValueError(f"batched reward returned {len(values)} values for {len(responses)} responses")
            return [RewardResult(_as_reward(v)) for v in values]
        except Exception:
            # Isolate the failing sample(s): rescore one at a time.
            return [self._score_one(r, g) for r, g in zip(responses, ground_truths, strict=True)]

    def score(self, responses: Sequence[str], ground_truths: Sequence[Any]) -> list[RewardResult]:
        """Score a batch synchronously (async functions run in a fresh event loop).

        Raises:
            ValueError: If the two sequences differ in length (a caller bug, not a reward failure).
            RuntimeError: If called with an async function from inside a running event loop; use
                :meth:`ascore` there.
        """
        _check_lengths(responses, ground_truths)
        if self.kind == "async":
            return asyncio.run(self.ascore(responses, ground_truths))
        if self.kind == "batched":
            return self._score_batched(responses, ground_truths)
        return [self._score_one(r, g) for r, g in zip(responses, ground_truths, strict=True)]

    async def ascore(self, responses: Sequence[str], ground_truths: Sequence[Any]) -> list[RewardResult]:
        """Score a batch from async code; async functions run concurrently, each under ``timeout_s``."""
        _check_lengths(responses, ground_truths)
        if self.kind != "async":
            return self.score(responses, ground_truths)
        pending = [self._ascore_one(r, g) for r, g in zip(responses, ground_truths, strict=True)]
        return list(await asyncio.gather(*pending))

    async def _ascore_one(self, response: str, ground_truth: Any) -> RewardResult:
        try:
            value = await asyncio.wait_for(self.fn(response, ground_truth, **self.kwargs), self.timeout_s)
            return RewardResult(_as_reward(value))
        except TimeoutError:
            return RewardResult(self.failure_reward, f"TimeoutError: no reward within {self.timeout_s} s")
        except Exception as exc:
            return self._fail(exc)


def _check_lengths(responses: Sequence[str], ground_truths: Sequence[Any]) -> None:
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")


def build_reward(cfg: RewardConfig) -> RewardScorer:
    """Resolve ``cfg.name`` and wrap it in a :class:`RewardScorer`.

    Raises:
        ValueError: If the function cannot be found, or ``kind`` contradicts it (a coroutine function
            declared scalar/batched, or a plain function declared async).
    """
    fn = resolve_reward_fn(cfg.name)
    # A callable object with an ``async def __call__`` counts as a coroutine function too.
    is_coroutine = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    kind = cfg.kind
    if kind == "auto":
        kind = "async" if is_coroutine else "scalar"
    if (kind == "async") != is_coroutine:
        nature = "a coroutine function" if is_coroutine else "not a coroutine function"
        raise ValueError(f"reward {cfg.name!r} declared kind={kind!r} but it is {nature}")
    return RewardScorer(fn, kind, cfg.kwargs, cfg.timeout_s, cfg.failure_reward)
