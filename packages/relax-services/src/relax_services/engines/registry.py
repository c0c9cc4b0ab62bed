"""Where engines are chosen: one explicit registry of dotted paths per engine kind, imported lazily.

This module is light (no torch): the preflight and the driver check a run config against the tables and the
installed packages (:func:`check_engines` finds each engine's module without importing it) before any heavy import
or Ray, and a service resolves its engine through the same tables, so a missing package gives the same message
whether the run stops at preflight or a service builds its engine directly.

``rollout.engine`` picks a rollout engine from :data:`ROLLOUT_ENGINES`, ``trainer.engine`` a training engine
from :data:`TRAIN_ENGINES`. Each value is ``"module:factory"``; the module is imported only when its engine is
chosen, so an optional backend (vLLM, megatron-core) costs nothing unless used, and a missing one raises an
ImportError that names the extra to install (:data:`OPTIONAL_EXTRAS`).

A factory takes the run config and returns an engine:

- rollout: ``factory(cfg: RunConfig, options: RolloutEngineOptions) -> RolloutEngine``
- training: ``factory(cfg: RunConfig, model: OmniModel | None, *, role: str, placement: RankOptions | None)
  -> TrainEngine`` (``model``: start from these weights instead of building the configured policy; ``role``: whose
  device and dtype, ``trainer`` or a role that only scores with it, the Reference; ``placement``: where a group's
  ranks go on a GPU run, None for one process; each is passed only when not its default, so a factory of the plain
  ``(cfg, model)`` signature builds the Trainer's engine of a CPU run)

A new backend is its module plus one entry here (or, for code outside the package, an entry added to the dict
at run time before the services start).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_services.config import RunConfig
    from relax_services.engines.protocols import PartialRolloutMode, RankOptions, RolloutEngine, TrainEngine
    from relax_services.models import OmniModel

__all__ = [
    "ENGINE_PACKAGES",
    "OPTIONAL_EXTRAS",
    "OWN_PROCESS_ROLLOUT_ENGINES",
    "ROLLOUT_ENGINES",
    "TEXT_ONLY_ROLLOUT_ENGINES",
    "TRAIN_ENGINES",
    "RolloutEngineOptions",
    "check_engines",
    "engine_path",
    "make_rollout_engine",
    "make_train_engine",
    "missing_engine_package",
    "missing_package_message",
    "missing_package_reason",
    "module_exists",
    "resolve",
]

ROLLOUT_ENGINES: dict[str, str] = {
    "hf": "relax_services.engines.hf:build_hf_rollout_engine",
    "vllm": "relax_services.engines.vllm:build_vllm_rollout_engine",
}
"""``rollout.engine`` id → ``"module:factory"`` of the rollout engine. ``hf``: batched incremental decoding of a
transformers model (CPU and GPU, the default). ``vllm``: vLLM's offline engine (extra ``relax-services[vllm]``,
settings ``rollout.vllm``)."""

TRAIN_ENGINES: dict[str, str] = {
    "torch": "relax_services.engines.torch:build_train_engine",
    "fsdp": "relax_services.engines.fsdp:build_trainer_group",
}
"""``trainer.engine`` id → ``"module:factory"`` of the training engine. ``torch``: single-process torch with
AdamW and gradient accumulation (the default). ``fsdp``: a group of ``trainer.world_size`` Ray actors training
one torch FSDP2-sharded policy (:class:`~relax_services.engines.fsdp.group.TrainerGroup`; the default when
``world_size`` > 1)."""

OPTIONAL_EXTRAS: dict[str, str] = {
    "vllm": "relax-services[vllm]",
    "megatron": "relax-services[megatron]",
    "megatron_core": "relax-services[megatron]",
}
"""Top-level module of an optional backend → the pip extra that installs it."""

ENGINE_PACKAGES: dict[str, dict[str, tuple[str, ...]]] = {
    "rollout.engine": {"vllm": ("vllm",)},
    "trainer.engine": {},
}
"""Config field → engine id → top-level modules the engine needs beyond the default install (its module imports
them only when an engine is built, so importing the module alone would not notice they are missing)."""

TEXT_ONLY_ROLLOUT_ENGINES: frozenset[str] = frozenset({"vllm"})
"""Rollout engines that take text prompts only (the preflight refuses synthetic media tasks with them)."""

OWN_PROCESS_ROLLOUT_ENGINES: frozenset[str] = frozenset({"vllm"})
"""Rollout engines that need a process of their own on the CPU (the preflight refuses ``run.mode=colocated`` with
them unless ``run.device=cuda``): vLLM's CPU attention fixes its thread count when the engine starts, and the
colocated services, threads of one process, set that process's torch thread count (measured: the first generate
call then fails a thread-count check)."""


def missing_package_message(field: str, name: str, package: str) -> str:
    """The error for ``field=name`` when ``package`` is not installed, naming its extra when it has one."""
    return f"{field}={name!r} {missing_package_reason(package)}"


def missing_package_reason(package: str) -> str:
    """``needs the package ..., which is not installed`` and, for an optional backend, the extra to install."""
    extra = OPTIONAL_EXTRAS.get(package)
    hint = f"; install it with `pip install '{extra}'`" if extra else ""
    return f"needs the package {package!r}, which is not installed{hint}"


def missing_engine_package(field: str, name: str) -> str | None:
    """The first package engine ``name`` of ``field`` needs that is not installed, or None (found without
    importing it)."""
    for package in ENGINE_PACKAGES.get(field, {}).get(name, ()):
        if importlib.util.find_spec(package) is None:
            return package
    return None


def module_exists(name: str) -> bool:
    """Whether dotted module ``name`` can be found, without running it or the packages above it (beyond the top
    one): ``relax_services.engines.x`` is looked up in the ``engines`` folder, whose ``__init__`` imports torch."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


def engine_path(registry: dict[str, str], name: str, *, field: str) -> str:
    """The ``"module:factory"`` registered as ``name``, its module found (not imported) and its packages installed.

    Args:
        registry: :data:`ROLLOUT_ENGINES` or :data:`TRAIN_ENGINES`.
        name: The configured id.
        field: The config field that chose it (for error messages), e.g. ``"rollout.engine"``.

    Raises:
        ValueError: ``name`` is not in ``registry`` (the message lists the known ids), or its path is not
            ``"module:factory"``.
        ImportError: The engine's module, or a package it needs, is not installed (for an optional backend the
            message names the extra to install).
    """
    path = registry.get(name)
    if path is None:
        raise ValueError(f"{field}={name!r} is not a registered engine; known: {', '.join(sorted(registry))}")
    package = missing_engine_package(field, name)  # a backend its module imports only when an engine is built
    if package is not None:
        raise ImportError(missing_package_message(field, name, package))
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field}={name!r}: {path!r} is not 'module:factory'")
    if not module_exists(module_name):
        raise ImportError(f"{field}={name!r}: its module {module_name!r} ({path!r}) cannot be found")
    return path


def check_engines(cfg: RunConfig) -> None:
    """Check ``rollout.engine`` and ``trainer.engine`` against the registries without importing any engine (the
    driver never imports the model stack): a bad id, a missing module or a missing extra fails in the driver
    before any service process starts; the factory itself is imported where the engine is built.

    Raises:
        ValueError, ImportError: As :func:`engine_path`.
    """
    engine_path(ROLLOUT_ENGINES, cfg.rollout.engine, field="rollout.engine")
    engine_path(TRAIN_ENGINES, cfg.trainer.engine, field="trainer.engine")


@dataclass(frozen=True)
class RolloutEngineOptions:
    """What a service asks of the rollout engine it builds, beyond the run config.

    Attributes:
        partial_rollout: How generation in flight meets new weights; None: ``rollout.partial_rollout``.
            The evaluator asks for ``"finish_old"`` (a greedy pass on one set of weights).
        role: Whose device and dtype the engine takes: ``rollout``, or ``eval`` (the Evaluator's).
    """

    partial_rollout: PartialRolloutMode | None = None
    role: str = "rollout"


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
    from relax_services.engines.protocols import RolloutEngine

    factory = resolve(ROLLOUT_ENGINES, cfg.rollout.engine, field="rollout.engine")
    engine = factory(cfg, options or RolloutEngineOptions())
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"rollout.engine={cfg.rollout.engine!r} built {type(engine).__name__}, not a RolloutEngine")
    return engine


def make_train_engine(
    cfg: RunConfig, model: OmniModel | None = None, *, role: str = "trainer", placement: RankOptions | None = None
) -> TrainEngine:
    """The training engine ``cfg.trainer.engine`` names, built by its registered factory on ``role``'s device (see
    the module's factory signature).

    Raises:
        TypeError: The factory returned something that is not a :class:`TrainEngine`.
    """
    from relax_services.engines.protocols import TrainEngine

    factory = resolve(TRAIN_ENGINES, cfg.trainer.engine, field="trainer.engine")
    # Only what differs from the defaults: a factory of the plain ``(cfg, model)`` signature builds the Trainer's.
    extra: dict[str, object] = {} if role == "trainer" else {"role": role}
    if placement is not None:
        extra["placement"] = placement
    engine = factory(cfg, model, **extra)
    if not isinstance(engine, TrainEngine):
        raise TypeError(f"trainer.engine={cfg.trainer.engine!r} built {type(engine).__name__}, not a TrainEngine")
    return engine
