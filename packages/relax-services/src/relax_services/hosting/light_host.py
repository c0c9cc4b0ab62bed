"""The run's light state in one Ray actor process: its queues, the policy weight store and the health monitor.

Each Ray worker process costs ≈ 65 MB before it does anything (``import ray``, and the pyarrow and numpy Ray's
serialisation imports), far more than the weight store's or the monitor's state: the store keeps a few object
references and publication records, the monitor one record per service. So relax-queue's group actor, which
holds the run's queues (:func:`relax_queue.create_ray_queues`), serves them too (its ``host`` class): both are
called often and briefly (a rollout asks for a newer version every few tens of milliseconds, each service beats
every quarter second) and their methods are plain and short, so they run on the queue actor's event loop without
the queues' callers waiting noticeably. Their method names do not overlap each other's or the queues', so one
class has every face: the queue clients, :class:`~relax_services.weights.RayWeightStore` and the services' health
handle address the same actor.

A failure domain changes with it: the death of this process takes the queues, the store and the monitor with it.
Each one's death was already a global restart from the last checkpoint (see ``_actor_watch``), so the run recovers
the same way; the watch names the other keys in the report of a death (a fault that kills ``prompt_queue``,
``sample_queue``, ``weights`` or ``health_monitor`` kills all four).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from relax_queue import QueueConfig, RayQueueClient, create_ray_queues
from relax_services.faults.monitor import HealthMonitor
from relax_services.weights import RayWeightStore, WeightStoreActor

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["LightActor", "WeightsAndMonitor", "create_light_actor"]


class WeightsAndMonitor(WeightStoreActor, HealthMonitor):
    """Body of the Ray actor that is both the run's policy weight store and its heartbeat collector.

    Args:
        keep: Versions whose objects the store keeps referenced (:class:`~relax_services.weights.WeightStoreActor`).
    """

    def __init__(self, keep: int = 2) -> None:
        WeightStoreActor.__init__(self, keep)
        HealthMonitor.__init__(self)


@dataclass
class LightActor:
    """The faces of the one light process: its queue clients by name, the policy weight store, the health monitor."""

    queues: dict[str, RayQueueClient]
    weights: RayWeightStore
    health: ActorHandle[WeightsAndMonitor]


def create_light_actor(name: str, configs: Mapping[str, QueueConfig], keep: int = 2) -> LightActor:
    """Start the named actor (``num_cpus=0``) holding the queues of ``configs`` (name → config), the policy weight
    store and the health monitor.

    Args:
        name: The actor's Ray name.
        configs: The queues it holds.
        keep: Versions the store keeps (:class:`~relax_services.weights.WeightStoreActor`).
    """
    queues = create_ray_queues(name, configs, host=WeightsAndMonitor, host_args=(keep,))
    # ray's stubs widen a class's handle (see RayWeightStore.create); each face sees the same actor by its own type.
    actor = next(iter(queues.values())).actor
    return LightActor(
        queues,
        RayWeightStore(cast("ActorHandle[WeightStoreActor]", actor)),
        cast("ActorHandle[WeightsAndMonitor]", actor),
    )
