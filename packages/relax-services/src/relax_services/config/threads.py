"""Run-config rule of compute threads (``run.threads``); light, like the rest of the config.

Torch splits a CPU kernel over its intra-op threads. Every process of a run that computes (a Trainer rank, a
rollout worker, the Reference, the Critic, the Evaluator) pins the same count, ``run.threads``, at every engine call,
so two processes computing the same update give the same bits (``relax_services.engines._threads``) and the
colocated mode's one process is not undone by its engines. Left unset, the launch resolves it once
(:func:`with_threads`): the machine's cores divided among the services that compute at once, at least 1, so the
run's threads never outnumber the cores (more threads than cores made forwards 20-50× slower under contention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_services.config import RunConfig

__all__ = ["UNLAUNCHED_THREADS", "compute_services", "threads_of", "with_threads"]

UNLAUNCHED_THREADS = 1
"""The count of an engine built from a config the launch did not resolve (tests, scripts, benchmarks)."""


def compute_services(cfg: RunConfig) -> int:
    """Services of the run that compute with torch at once: the Trainer's ranks, the rollout workers, the Evaluator,
    and the Reference and the Critic when the algorithm has them (the Reward runs the user's function, not
    torch)."""
    algo = cfg.algorithm
    return cfg.trainer.world_size + cfg.rollout.replicas + 1 + int(algo.uses_reference) + int(algo.uses_critic)


def with_threads(cfg: RunConfig, cores: int) -> RunConfig:
    """``cfg`` with ``run.threads`` set: as given, or ``cores // compute_services(cfg)``, at least 1."""
    if cfg.run.threads is not None:
        return cfg
    threads = max(1, cores // compute_services(cfg))
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"threads": threads})})


def threads_of(cfg: RunConfig) -> int:
    """The intra-op thread count every engine of the run computes with."""
    return cfg.run.threads if cfg.run.threads is not None else UNLAUNCHED_THREADS
