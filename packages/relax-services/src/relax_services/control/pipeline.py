"""Builders that wire a run's services together, one per algorithm family (an explicit registry dict).

A pipeline is: a prompt queue (task ``rollout``), a sample queue (tasks ``reward``, ``reference`` when a KL
term is used, ``critic`` for PPO, and ``trainer``), versioned weight stores (policy; critic for PPO), a health
monitor (the two queues, the policy store and the monitor share one light process,
:mod:`relax_services.hosting.light_host`), and one Ray actor per service, each in its own process, except the roles
``run.hosts`` puts in one shared host actor (:mod:`relax_services.hosting.cohost`). Services talk only through the
queues
and the weight stores.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core import ALGORITHMS, algorithm_spec
from relax_queue import (
    BoundedStaleness,
    Capacity,
    QueueClient,
    QueueConfig,
    RayQueueClient,
    TaskSpec,
)
from relax_services.config import RunConfig
from relax_services.config.hosts import host_resource
from relax_services.config.services import MAX_REPLICAS
from relax_services.control.checkpoint import ENGINE_FILE, load_queue_snapshots
from relax_services.data.prompts import HeldoutSet, PromptBuilder
from relax_services.engines.registry import check_engines
from relax_services.hosting.cohost import SharedHost, actor_options
from relax_services.hosting.light_host import LightActor, create_light_actor  # light: its actor imports no model stack
from relax_services.hosting.placement import Placement, host_members, host_name, service_roles
from relax_services.hosting.service_host import SERVICE_CLASSES, host_class
from relax_services.rows import HeldoutItem
from relax_services.weights import RayWeightStore, WeightStore
from relax_services.weights.broadcast_store import BroadcastWeightStore

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from relax_services.services._base import ServiceBase

__all__ = [
    "ALGORITHM_BUILDERS",
    "PIPELINE_BUILDERS",
    "Pipeline",
    "PlannedService",
    "ServiceSpec",
    "build_pipeline",
    "pipeline_family",
    "queue_configs",
    "service_plan",
    "shared_hosts",
]


@dataclass
class ServiceSpec:
    """How to (re)create one service actor: restarts call :meth:`create` again with the same arguments.

    ``cls`` is the service's ``"module:Class"`` path (the actor is a :class:`~relax_services.hosting.service_host.
    ServiceHost` that imports it in its own process, so the driver never imports the service's model stack), or a
    service class itself (Ray imports its module here too)."""

    name: str
    role: str
    cls: type | str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    handle: Any = None
    pid: int | None = None
    restarts: int = 0
    resource: str | None = None
    host: SharedHost | None = None
    """The host whose process this service shares with others (``run.hosts``); None: an actor of its own."""
    placement: dict[str, object] = field(default_factory=dict)
    """Ray options placing its own actor on a GPU run: its GPUs and its placement-group bundle
    (:meth:`~relax_services.hosting.placement.Placement.options`); empty on a CPU run."""

    @property
    def actor(self) -> ActorHandle[object]:
        """The Ray actor whose process runs this service: its own, or its host's (what ``ray.kill`` ends)."""
        actor: ActorHandle[object] = self.host.actor if self.host is not None else self.handle
        return actor

    def launch(self, namespace: str) -> ObjectRef[int]:
        """Create the actor (a hosted service: its host, unless a fellow member created it already) and ask the
        service to start; returns the start call's reference (its process id)."""
        if self.host is None:
            self.spawn(namespace)
        elif self.host.actor is None:
            self.host.spawn(namespace)
        started: ObjectRef[int] = self.handle.start.remote()
        return started

    def spawn(self, namespace: str) -> None:
        """Create the actor without starting its work loop: its process imports and builds itself meanwhile.

        Raises:
            RuntimeError: the service is hosted: its process is its host's (:meth:`SharedHost.replace`).
        """
        import ray

        if self.host is not None:
            raise RuntimeError(f"service {self.name} shares host {self.host.name}: replace the host, not the service")

        # A path is hosted (imported in the actor's process only); a class is Ray's actor class itself.
        actor_cls: Any = ray.remote(host_class(self.cls) if isinstance(self.cls, str) else self.cls)
        prefix = (self.cls,) if isinstance(self.cls, str) else ()
        options = actor_options(f"{namespace}-{self.name}-{self.restarts}", 1, self.resource) | self.placement
        self.handle = actor_cls.options(**options).remote(*prefix, self.name, *self.args, **self.kwargs)

    def start_loop(self, timeout: float = 300.0) -> int:
        """Start the work loop of the actor :meth:`spawn` created, waiting until it runs; returns its process id."""
        import ray

        self.pid = int(ray.get(self.handle.start.remote(), timeout=timeout))
        return self.pid

    def create(self, namespace: str, timeout: float = 300.0) -> ActorHandle[ServiceBase]:
        """Create and start the actor, waiting until its work loop runs."""
        import ray

        self.pid = ray.get(self.launch(namespace), timeout=timeout)
        handle: ActorHandle[ServiceBase] = self.handle
        return handle


@dataclass
class Pipeline:
    """Everything a controller drives for one run."""

    cfg: RunConfig
    namespace: str
    prompt_queue: RayQueueClient
    sample_queue: RayQueueClient
    weights: RayWeightStore | BroadcastWeightStore
    health: Any  # the HealthMonitor actor's handle
    services: dict[str, ServiceSpec]
    critic_weights: RayWeightStore | None = None
    hosts: list[SharedHost] = field(default_factory=list)
    """The processes several services share (``run.hosts``); their members are in ``services`` too."""
    placement: Placement | None = None
    """The placement groups of a GPU run (None on a CPU run), released when the pipeline stops."""

    def start(self, watch: Callable[[], None] | None = None, poll_s: float = 0.25, timeout_s: float = 600.0) -> None:
        """Start every service at once (their processes import and build models in parallel).

        Each service's ``pid`` is set as its start returns, so after an interrupted start the services with a
        ``pid`` are the ones that came up.

        Args:
            watch: Called before each wait of ``poll_s`` seconds while services are still starting (the
                controller's :meth:`~relax_services.faults.actor_watch.ActorWatch.poll`): an actor that died
                meanwhile raises there at once, instead of after every service came up (tens of seconds of model
                imports and builds).
            poll_s: Seconds between ``watch`` calls.
            timeout_s: Seconds every service has to start.

        Raises:
            ray.exceptions.GetTimeoutError: Some services did not start within ``timeout_s`` (they are named).
            Exception: What ``watch`` raised, or the error of a service whose start failed.
        """
        import ray

        starting = {spec.launch(self.namespace): spec for spec in self.services.values()}
        deadline = time.monotonic() + timeout_s
        while starting:
            if watch is not None:
                watch()
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(spec.name for spec in starting.values())
                raise ray.exceptions.GetTimeoutError(f"services not started within {timeout_s:.0f} s: {names}")
            wait_s = left if watch is None else min(poll_s, left)
            done, _ = ray.wait(list(starting), num_returns=len(starting), timeout=wait_s)
            for ref in done:
                spec = starting.pop(ref)
                spec.pid = int(ray.get(ref))

    def node_ids(self) -> dict[str, str]:
        """The Ray node each service runs on."""
        import ray

        return dict(
            zip(self.services, ray.get([s.handle.node_id.remote() for s in self.services.values()]), strict=True)
        )

    def actors(self) -> dict[str, Any]:
        """The pipeline's actors that are not services, by the keys faults target them with: the queues, the weight
        stores and the health monitor (an :class:`relax_services.faults.actor_watch.ActorWatch` watches them; keys whose
        handles are equal share one process, as ``weights`` and ``health_monitor`` do in a built pipeline)."""
        actors = {
            "prompt_queue": self.prompt_queue.actor,
            "sample_queue": self.sample_queue.actor,
            "weights": self.weights.actor,
            "health_monitor": self.health,
        }
        if self.critic_weights is not None:
            actors["critic_weights"] = self.critic_weights.actor
        return actors

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every service loop, then end their processes and the queue and store actors (any of them may be
        dead already; stopping twice is harmless)."""
        import ray

        stops = []
        for spec in self.services.values():
            # Only a started service has a loop to stop: one still building (an interrupted start) would answer
            # only once its constructor ended, so it is killed below without waiting for it.
            if spec.handle is not None and spec.pid is not None:
                with contextlib.suppress(Exception):  # a handle whose actor is gone
                    stops.append(spec.handle.stop.remote())
        with contextlib.suppress(Exception):  # a dead or hung service is killed below all the same
            ray.get(stops, timeout=timeout)
        for actor in {
            id(spec.actor): spec.actor for spec in self.services.values() if spec.handle is not None
        }.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        for actor in self.actors().values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self.placement is not None:
            self.placement.remove()


def queue_configs(cfg: RunConfig) -> tuple[QueueConfig, QueueConfig]:
    """The prompt queue's and the sample queue's configs (the same in every transport)."""
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
    return prompts, samples


def _light_actor(cfg: RunConfig, namespace: str) -> LightActor:
    """The run's prompt and sample queues, its policy weight store and its health monitor, all held by one light
    actor process (a Ray worker's imports cost more than their state; the death of any of them was a global restart
    already)."""
    prompts, samples = queue_configs(cfg)
    return create_light_actor(f"{namespace}-light", {"prompts": prompts, "samples": samples}, keep=1)


def build_grpo(
    cfg: RunConfig, heldout: Heldout, restore: Path | None = None, *, to_prompt: PromptBuilder | None = None
) -> Pipeline:
    """Critic-free group algorithms (GRPO, Dr.GRPO, DAPO, GSPO, RLOO, REINFORCE++): Rollout workers, Reward,
    Reference (when the KL coefficient is positive), Trainer and a held-out Evaluator (``to_prompt``: see
    :func:`service_plan`)."""
    return _build(cfg, heldout, restore, to_prompt, critic=False)


def build_ppo(
    cfg: RunConfig, heldout: Heldout, restore: Path | None = None, *, to_prompt: PromptBuilder | None = None
) -> Pipeline:
    """PPO with a critic (GAE on-policy, V-trace targets for stale data): the GRPO services plus a Critic that
    writes values under the critic weights the Trainer trains and publishes."""
    return _build(cfg, heldout, restore, to_prompt, critic=True)


Heldout = list[HeldoutItem] | HeldoutSet
"""The Evaluator's held-out set: the prompts, or the rows it builds them from in its own process."""

PlannedService = tuple[str, str, str, tuple[Any, ...], dict[str, Any]]
"""``(name, role, the service class's "module:Class" path, positional args after the name, keyword args)`` of one
service (:data:`~relax_services.hosting.service_host.SERVICE_CLASSES` names each role's class)."""


def service_plan(
    cfg: RunConfig,
    heldout: Heldout,
    restore: Path | None,
    prompt_queue: QueueClient,
    sample_queue: QueueClient,
    weights: WeightStore,
    critic_weights: WeightStore | None,
    to_prompt: PromptBuilder | None = None,
    placement: Placement | None = None,
) -> list[PlannedService]:
    """The services of a run and their arguments, whatever runs them (Ray actors or threads of one process):
    Trainer, Rollout workers, Reward, Reference (KL term), Critic (an estimator with a critic) and Evaluator
    (:func:`~relax_services.hosting.placement.service_roles`). With ``to_prompt`` the Rollout workers build each
    prompt from the record rows the feeder puts; ``placement`` places a Trainer group's ranks on a GPU run."""
    engine_state = None if restore is None else str(restore / ENGINE_FILE)
    ranks = None if placement is None else placement.trainer_ranks()
    args: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
        "trainer": ((cfg, sample_queue, weights, engine_state), {"critic_weights": critic_weights, "placement": ranks}),
        "reward": ((cfg, sample_queue), {}),
        "reference": ((cfg, sample_queue), {}),
        "critic": ((cfg, sample_queue, critic_weights), {}),
        "eval": ((cfg, heldout, weights), {}),
    }
    plan: list[PlannedService] = []
    for name, role in service_roles(cfg):
        if role == "rollout":
            i = int(name.rpartition("-")[2])
            worker_weights = weights.for_worker(i) if isinstance(weights, BroadcastWeightStore) else weights
            plan.append(
                (
                    name,
                    role,
                    SERVICE_CLASSES[role],
                    (cfg, prompt_queue, sample_queue, worker_weights),
                    {"to_prompt": to_prompt},
                )
            )
        else:
            plan.append((name, role, SERVICE_CLASSES[role], *args[role]))
    return plan


def _build(
    cfg: RunConfig, heldout: Heldout, restore: Path | None, to_prompt: PromptBuilder | None, *, critic: bool
) -> Pipeline:
    import ray

    namespace = f"relax-{uuid.uuid4().hex[:8]}"
    created: list[Any] = []  # actors made so far: a build that fails midway (an actor died) must not leave them
    placement = Placement.create(cfg, namespace)  # first: a cluster that cannot hold the run stops it here
    try:
        light = _light_actor(cfg, namespace)
        created.append(light.health)  # the one actor of both queues, the policy store and the monitor
        prompt_queue, sample_queue = light.queues["prompts"], light.queues["samples"]
        store, health = light.weights, light.health
        if restore is not None:  # leased-but-unacked rows of the snapshot are delivered again
            load_queue_snapshots(prompt_queue, sample_queue, restore)
        weights: RayWeightStore | BroadcastWeightStore = store
        if cfg.trainer.weight_sync == "broadcast":
            from relax_services.weights.broadcast import BroadcastConfig

            # Every slot a replica may take (rollout-i registers slot i, joining and leaving as the run scales).
            sync = BroadcastConfig(receivers=MAX_REPLICAS)
            weights = BroadcastWeightStore.create(store, sync, bucket_bytes=int(cfg.trainer.sync_bucket_mib * 2**20))
        critic_weights = RayWeightStore.create(name=f"{namespace}-critic-weights", keep=1) if critic else None
        if critic_weights is not None:
            created.append(critic_weights.actor)
    except BaseException:
        for actor in created:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if placement is not None:
            placement.remove()
        raise
    services: dict[str, ServiceSpec] = {}
    for name, role, cls, args, kwargs in service_plan(
        cfg, heldout, restore, prompt_queue, sample_queue, weights, critic_weights, to_prompt, placement
    ):
        resource = cfg.run.placement.get(role)
        options = {} if placement is None else placement.options(name)
        services[name] = ServiceSpec(
            name, role, cls, args, {**kwargs, "health": health}, resource=resource, placement=options
        )
    hosts = shared_hosts(cfg.run.hosts, services)
    for host in hosts:
        host.placement = {} if placement is None else placement.options(host.name)
    return Pipeline(
        cfg, namespace, prompt_queue, sample_queue, weights, health, services, critic_weights, hosts, placement
    )


def shared_hosts(hosts: list[list[str]], services: dict[str, ServiceSpec]) -> list[SharedHost]:
    """The hosts of ``run.hosts`` over a pipeline's services (:func:`~relax_services.hosting.placement.host_members`:
    the rule the placement of a GPU run follows too), each member's ``host`` set."""
    out: list[SharedHost] = []
    for names in host_members(hosts, [(spec.name, spec.role) for spec in services.values()]):
        members = [services[name] for name in names]
        name = host_name(names)
        host = SharedHost(name, members, resource=host_resource([spec.resource for spec in members]))
        for spec in members:
            spec.host = host
        out.append(host)
    return out


PipelineBuilder = Callable[..., Pipeline]
"""``builder(cfg, heldout, restore, *, to_prompt=None)`` (called without ``to_prompt`` when there is none)."""

PIPELINE_BUILDERS: dict[str, PipelineBuilder] = {"grpo": build_grpo, "ppo": build_ppo}
"""Pipeline family → builder: ``ppo`` for estimators that need a critic, ``grpo`` for the rest."""


def pipeline_family(estimator: str) -> str:
    """The pipeline family an advantage estimator runs in, read from relax-core's algorithm table."""
    return "ppo" if algorithm_spec(estimator).needs_critic else "grpo"


ALGORITHM_BUILDERS: dict[str, PipelineBuilder] = {name: PIPELINE_BUILDERS[pipeline_family(name)] for name in ALGORITHMS}
"""Advantage estimator → pipeline builder for the built-in table (:func:`build_pipeline` reads the table itself,
so an entry added to ``relax_core.ALGORITHMS`` later is built too)."""


def build_pipeline(
    cfg: RunConfig, heldout: Heldout, restore: Path | None = None, *, to_prompt: PromptBuilder | None = None
) -> Pipeline:
    """The pipeline for ``cfg.algorithm``'s estimator (its engines are checked first: a bad ``rollout.engine`` or
    ``trainer.engine``, or a missing extra, fails here rather than in a service process; ``to_prompt``: see
    :func:`service_plan`)."""
    check_engines(cfg)
    family = PIPELINE_BUILDERS[pipeline_family(cfg.algorithm.advantage_estimator)]
    if to_prompt is None:  # a builder of the table's first signature, ``(cfg, heldout, restore)``, still fits
        return family(cfg, heldout, restore)
    return family(cfg, heldout, restore, to_prompt=to_prompt)
