"""Builders that wire a run's services together, one per algorithm family (an explicit registry dict).

A pipeline is: a prompt queue (task ``rollout``), a sample queue (tasks ``reward``, ``reference`` when a KL
term is used, ``critic`` for PPO, and ``trainer``), versioned weight stores (policy; critic for PPO), a health
monitor, and one Ray actor per service, each in its own process. Services talk only through the queues and the
weight stores.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_queue import BoundedStaleness, Capacity, QueueConfig, TaskSpec, create_ray_queue
from relax_services._health_monitor import HealthMonitor  # light: its actor does not import the model stack
from relax_services.checkpoint import ENGINE_FILE, PROMPTS_FILE, SAMPLES_FILE
from relax_services.config import RunConfig
from relax_services.services import (
    CriticService,
    EvalService,
    ReferenceService,
    RewardService,
    RolloutService,
    TrainerService,
)
from relax_services.weights import RayWeightStore

__all__ = ["ALGORITHM_BUILDERS", "Pipeline", "ServiceSpec", "build_pipeline"]


@dataclass
class ServiceSpec:
    """How to (re)create one service actor: restarts call :meth:`create` again with the same arguments."""

    name: str
    role: str
    cls: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    handle: Any = None
    pid: int | None = None
    restarts: int = 0
    resource: str | None = None

    def launch(self, namespace: str) -> Any:
        """Create the actor and ask it to start; returns the start call's reference (its process id)."""
        import ray

        actor_cls: Any = ray.remote(self.cls)
        options: dict[str, Any] = {
            "name": f"{namespace}-{self.name}-{self.restarts}",
            "num_cpus": 0,
            "max_concurrency": 4,
            "max_restarts": 0,
        }
        if self.resource is not None:
            options["resources"] = {self.resource: 0.01}
        self.handle = actor_cls.options(**options).remote(self.name, *self.args, **self.kwargs)
        return self.handle.start.remote()

    def create(self, namespace: str, timeout: float = 300.0) -> Any:
        """Create and start the actor, waiting until its work loop runs."""
        import ray

        self.pid = ray.get(self.launch(namespace), timeout=timeout)
        return self.handle


@dataclass
class Pipeline:
    """Everything a controller drives for one run."""

    cfg: RunConfig
    namespace: str
    prompt_queue: Any
    sample_queue: Any
    weights: Any
    health: Any
    services: dict[str, ServiceSpec]
    critic_weights: Any = None

    def start(self) -> None:
        """Start every service at once (their processes import and build models in parallel)."""
        import ray

        specs = list(self.services.values())
        pids = ray.get([spec.launch(self.namespace) for spec in specs], timeout=600)
        for spec, pid in zip(specs, pids, strict=True):
            spec.pid = pid

    def node_ids(self) -> dict[str, str]:
        """The Ray node each service runs on."""
        import ray

        return dict(
            zip(self.services, ray.get([s.handle.node_id.remote() for s in self.services.values()]), strict=True)
        )

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every service loop, then end their processes and the queue and store actors."""
        import ray

        stops = [s.handle.stop.remote() for s in self.services.values() if s.handle is not None]
        with contextlib.suppress(Exception):  # a dead or hung service is killed below all the same
            ray.get(stops, timeout=timeout)
        for spec in self.services.values():
            if spec.handle is not None:
                ray.kill(spec.handle, no_restart=True)
        stores = [self.weights] if self.critic_weights is None else [self.weights, self.critic_weights]
        for actor in (self.prompt_queue.actor, self.sample_queue.actor, *(w.actor for w in stores), self.health):
            ray.kill(actor, no_restart=True)


def _queues(cfg: RunConfig, namespace: str) -> tuple[Any, Any]:
    sample_tasks = [TaskSpec("reward")]
    if cfg.algorithm.uses_reference:
        sample_tasks.append(TaskSpec("reference"))
    if cfg.algorithm.uses_critic:
        sample_tasks.append(TaskSpec("critic"))
    sample_tasks.append(TaskSpec("trainer", check_staleness=True))
    samples = QueueConfig(
        tasks=tuple(sample_tasks),
        capacity=Capacity(max_rows=cfg.queue.max_rows, max_bytes=cfg.queue.max_bytes),
        staleness=BoundedStaleness(
            tau=cfg.staleness.tau, on_stale=cfg.staleness.on_stale, batch_size=cfg.samples_per_step
        ),
        lease_timeout_s=cfg.queue.lease_timeout_s,
    )
    # Prompts wait here for a Rollout worker; a short lease brings back the prompts of a worker that died.
    prompts = QueueConfig(
        tasks=(TaskSpec("rollout"),),
        capacity=Capacity(max_rows=4 * cfg.trainer.groups_per_step),
        lease_timeout_s=min(cfg.queue.lease_timeout_s, 15.0),
    )
    return create_ray_queue(f"{namespace}-prompts", prompts), create_ray_queue(f"{namespace}-samples", samples)


def build_grpo(cfg: RunConfig, heldout: list[tuple[str, Any, str]], restore: Path | None = None) -> Pipeline:
    """Critic-free group algorithms (GRPO, Dr.GRPO, DAPO, GSPO, RLOO, REINFORCE++): Rollout workers, Reward,
    Reference (when the KL coefficient is positive), Trainer and a held-out Evaluator."""
    return _build(cfg, heldout, restore, critic=False)


def build_ppo(cfg: RunConfig, heldout: list[tuple[str, Any, str]], restore: Path | None = None) -> Pipeline:
    """PPO with a critic (GAE on-policy, V-trace targets for stale data): the GRPO services plus a Critic that
    writes values under the critic weights the Trainer trains and publishes."""
    return _build(cfg, heldout, restore, critic=True)


def _build(cfg: RunConfig, heldout: list[tuple[str, Any, str]], restore: Path | None, *, critic: bool) -> Pipeline:
    import ray

    namespace = f"relax-{uuid.uuid4().hex[:8]}"
    prompt_queue, sample_queue = _queues(cfg, namespace)
    if restore is not None:  # leased-but-unacked rows of the snapshot are delivered again
        prompt_queue.load(str(restore / PROMPTS_FILE), reset_running=False)
        sample_queue.load(str(restore / SAMPLES_FILE), reset_running=False)
    weights = RayWeightStore.create(name=f"{namespace}-weights", keep=2)
    critic_weights = RayWeightStore.create(name=f"{namespace}-critic-weights", keep=2) if critic else None
    health = ray.remote(HealthMonitor).options(name=f"{namespace}-health", num_cpus=0).remote()
    services: dict[str, ServiceSpec] = {}

    def add(name: str, role: str, cls: type, *args: Any, **kwargs: Any) -> None:
        resource = cfg.run.placement.get(role)
        services[name] = ServiceSpec(name, role, cls, args, {**kwargs, "health": health}, resource=resource)

    engine_state = None if restore is None else str(restore / ENGINE_FILE)
    add("trainer", "trainer", TrainerService, cfg, sample_queue, weights, engine_state, critic_weights=critic_weights)
    for i in range(cfg.rollout.num_workers):
        add(f"rollout-{i}", "rollout", RolloutService, cfg, prompt_queue, sample_queue, weights)
    add("reward", "reward", RewardService, cfg, sample_queue)
    if cfg.algorithm.uses_reference:
        add("reference", "reference", ReferenceService, cfg, sample_queue)
    if critic_weights is not None:
        add("critic", "critic", CriticService, cfg, sample_queue, critic_weights)
    add("eval", "eval", EvalService, cfg, heldout, weights)
    return Pipeline(cfg, namespace, prompt_queue, sample_queue, weights, health, services, critic_weights)


PipelineBuilder = Callable[[RunConfig, list[tuple[str, Any, str]], "Path | None"], Pipeline]

ALGORITHM_BUILDERS: dict[str, PipelineBuilder] = {
    "grpo": build_grpo,
    "rloo": build_grpo,
    "reinforce_pp": build_grpo,
    "reinforce_pp_baseline": build_grpo,
    "gae": build_ppo,
    "vtrace": build_ppo,
}
"""Advantage estimator → pipeline builder."""


def build_pipeline(cfg: RunConfig, heldout: list[tuple[str, Any, str]], restore: Path | None = None) -> Pipeline:
    """The pipeline for ``cfg.algorithm``'s estimator."""
    return ALGORITHM_BUILDERS[cfg.algorithm.advantage_estimator](cfg, heldout, restore)
