"""Where engines are chosen: one explicit registry of dotted paths per engine kind, imported lazily.

``rollout.engine`` picks a rollout engine from :data:`ROLLOUT_ENGINES`, ``trainer.engine`` a training engine
from :data:`TRAIN_ENGINES`. Each value is ``"module:factory"``; the module is imported only when its engine is
chosen, so an optional backend (vLLM, megatron-core) costs nothing unless used, and a missing one raises an
ImportError that names the extra to install (:data:`OPTIONAL_EXTRAS`).

A factory takes the run config and returns an engine:

- rollout: ``factory(cfg: RunConfig, options: RolloutEngineOptions) -> RolloutEngine``
- training: ``factory(cfg: RunConfig, model: OmniModel | None) -> TrainEngine`` (``model``: start from these
  weights instead of building the configured policy)

A new backend is its module plus one entry here (or, for code outside the package, an entry added to the dict
at run time before the services start).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relax_services._engine_extras import (  # the tables live in a light module: the driver reads them too
    OPTIONAL_EXTRAS,
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    check_engines,
    engine_path,
    missing_package_message,
)
from relax_services.engines.protocols import PartialRolloutMode, RolloutEngine, TrainEngine

if TYPE_CHECKING:
    from relax_services.config import RunConfig
    from relax_services.models import OmniModel

__all__ = [
    "OPTIONAL_EXTRAS",
    "ROLLOUT_ENGINES",
    "TRAIN_ENGINES",
    "RolloutEngineOptions",
    "check_engines",
    "make_rollout_engine",
    "make_train_engine",
    "resolve",
]


@dataclass(frozen=True)
class RolloutEngineOptions:
    """What a service asks of the rollout engine it builds, beyond the run config.

    Attributes:
        partial_rollout: How generation in flight meets new weights; None: ``rollout.partial_rollout``.
            The evaluator asks for ``"finish_old"`` (a greedy pass on one set of weights).
    """

    partial_rollout: PartialRolloutMode | None = None


def resolve(registry: dict[str, str], name: str, *, field: str) -> Callable[..., object]:
    """Import and return the factory registered as ``name``.

    Args:
        registry: One of :data:`ROLLOUT_ENGINES`, :data:`TRAIN_ENGINES`.
        name: The configured id.
        field: The config field that chose it (for error messages), e.g. ``"rollout.engine"``.

    Raises:
        ValueError: ``name`` is not in ``registry`` (the message lists the known ids).
        ImportError: The backend's module (or a package it needs) is missing; for an optional backend the
            message names the extra to install.
    """
    path = engine_path(registry, name, field=field)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        raise ImportError(missing_package_message(field, name, missing)) from exc
    factory: object = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{field}={name!r}: {path!r} does not name a callable")
    return factory


def make_rollout_engine(cfg: RunConfig, options: RolloutEngineOptions | None = None) -> RolloutEngine:
    """The rollout engine ``cfg.rollout.engine`` names, built by its registered factory.

    Raises:
        TypeError: The factory returned something that is not a :class:`RolloutEngine`.
    """
    factory = resolve(ROLLOUT_ENGINES, cfg.rollout.engine, field="rollout.engine")
    engine = factory(cfg, options or RolloutEngineOptions())
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"rollout.engine={cfg.rollout.engine!r} built {type(engine).__name__}, not a RolloutEngine")
    return engine


def make_train_engine(cfg: RunConfig, model: OmniModel | None = None) -> TrainEngine:
    """The training engine ``cfg.trainer.engine`` names, built by its registered factory.

    Raises:
        TypeError: The factory returned something that is not a :class:`TrainEngine`.
    """
    factory = resolve(TRAIN_ENGINES, cfg.trainer.engine, field="trainer.engine")
    engine = factory(cfg, model)
    if not isinstance(engine, TrainEngine):
        raise TypeError(f"trainer.engine={cfg.trainer.engine!r} built {type(engine).__name__}, not a TrainEngine")
    return engine
