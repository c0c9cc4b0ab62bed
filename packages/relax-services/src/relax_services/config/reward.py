"""The run's reward config: the default reward by registry name or user function, routes by ``data_source``,
the per-call timeout and the fallback score; it becomes relax-core's :class:`~relax_core.RewardRunnerConfig`."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pydantic

from relax_core import ConfigModel, RewardKind, RewardRunnerConfig, RewardSpec

__all__ = ["RunRewardConfig", "absolute_file_spec"]

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9_,.-]+\])?([<>=!~]=?[A-Za-z0-9.*+!-]+)?")


def absolute_file_spec(spec: str) -> str:
    """``path/file.py:fn`` with the path made absolute (the services run in other processes, whose working
    directory need not be this one); any other spec unchanged."""
    file_part, sep, attr = spec.rpartition(":")
    if not (sep and file_part.endswith(".py")) or os.path.isabs(file_part):
        return spec
    return f"{Path(file_part).resolve()}:{attr}"


class RunRewardConfig(ConfigModel):
    """Which reward scores each sample (Reward and Eval services), and what a failing reward gives."""

    name: str = "exact_match"
    """The default reward by registry name (exact_match, multiple_choice, math, math_verify, format, regex,
    length_penalty, weighted) or dotted path (``my_pkg.rewards:score``); ``fn`` replaces it when set."""

    fn: str | None = None
    """A user reward: ``module:function`` or ``path/to/file.py:function`` (relative to the working directory
    of ``relax train``), called as ``fn(response, ground_truth, metadata)`` or verl's
    ``compute_score(data_source, solution_str, ground_truth, extra_info)``; returns a float or a dict with a
    ``"score"``. None: the ``name`` reward."""

    kwargs: dict[str, Any] = pydantic.Field(default_factory=dict)
    """Keyword arguments passed to every call of the default reward."""

    kind: RewardKind = "auto"
    """Calling convention of the default reward: scalar, batched, async, async_batched; auto reads it from
    the function."""

    routes: dict[str, RewardSpec] = pydantic.Field(default_factory=dict)
    """``data_source`` → its own reward (``{fn, kwargs, kind, remote}``); unrouted samples get the default."""

    timeout_s: float = pydantic.Field(default=30.0, gt=0.0)
    """Seconds one reward call may take; past it the sample gets ``fallback_score`` and a timeout error."""

    fallback_score: float = 0.0
    """Reward of a sample whose reward function raised, timed out or returned something unusable (the error
    is kept in the sample's ``reward_error`` and counted in the metrics)."""

    max_concurrency: int = pydantic.Field(default=16, ge=1)
    """Reward calls in flight at once per service."""

    requirements: list[str] = pydantic.Field(default_factory=list)
    """Modules the reward imports (``rapidfuzz``), checked before Ray starts: a missing one is an error naming it
    and the command that installs it. Write ``module=package`` where the installed package is named otherwise
    (``sklearn=scikit-learn``)."""

    @pydantic.field_validator("requirements")
    @classmethod
    def _requirement_names(cls, requirements: list[str]) -> list[str]:
        for entry in requirements:
            module, _, package = entry.partition("=")
            if not _MODULE.fullmatch(module) or (package and not _PACKAGE.fullmatch(package)):
                raise ValueError(f"{entry!r} is not 'module' or 'module=package' (e.g. 'sklearn=scikit-learn')")
        return requirements

    def required_modules(self) -> dict[str, str]:
        """``reward.requirements`` as module → the package that installs it."""
        return {m: p or m.partition(".")[0] for m, _, p in (e.partition("=") for e in self.requirements)}

    @pydantic.model_validator(mode="after")
    def _absolute_files(self) -> RunRewardConfig:
        fn = None if self.fn is None else absolute_file_spec(self.fn)
        routes = {
            source: spec.model_copy(update={"fn": absolute_file_spec(spec.fn)}) for source, spec in self.routes.items()
        }
        if fn != self.fn or any(routes[s].fn != self.routes[s].fn for s in routes):
            # Assigning re-runs this validator; the second pass finds every path absolute and stops.
            object.__setattr__(self, "fn", fn)
            object.__setattr__(self, "routes", routes)
        return self

    def runner_config(self) -> RewardRunnerConfig:
        """relax-core's runner config of this reward."""
        default = RewardSpec(fn=self.fn or self.name, kwargs=dict(self.kwargs), kind=self.kind)
        return RewardRunnerConfig(
            default=default,
            routes=dict(self.routes),
            timeout_s=self.timeout_s,
            fallback_score=self.fallback_score,
            max_concurrency=self.max_concurrency,
        )
