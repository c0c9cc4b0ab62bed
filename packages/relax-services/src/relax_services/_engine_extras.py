"""Which engines need an optional package, and the extra that installs it; light (no torch), so that the
preflight checks a run config against the installed packages before any heavy import or Ray.

:mod:`relax_services.engines.registry` resolves engines through the same tables, so a missing package gives the
same message whether the run stops at preflight or a service builds its engine directly.
"""

from __future__ import annotations

import importlib.util

__all__ = [
    "ENGINE_PACKAGES",
    "OPTIONAL_EXTRAS",
    "OWN_PROCESS_ROLLOUT_ENGINES",
    "TEXT_ONLY_ROLLOUT_ENGINES",
    "missing_engine_package",
    "missing_package_message",
    "missing_package_reason",
]

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
"""Rollout engines that need a process of their own (the preflight refuses ``run.mode=colocated`` with them): vLLM's
CPU attention fixes its thread count when the engine starts, and the colocated services, threads of one process,
set that process's torch thread count (measured: the first generate call then fails a thread-count check)."""


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
