"""The policy weight store and the health monitor in one light Ray actor process.

Each Ray worker process costs ≈ 65 MB before it does anything (``import ray``, and the pyarrow and numpy Ray's
serialisation imports), far more than either actor's state: the store keeps a few object references and
publication records, the monitor one record per service. Both are called often and briefly (a rollout asks for a
newer version every few tens of milliseconds, each service beats every quarter second), so one process serves
both without either waiting noticeably on the other. Their method names do not overlap, so one class has both
faces: :class:`~relax_services.weights.RayWeightStore` and the services' health handle address the same actor.

A failure domain changes with it: the death of this process takes both with it. Either one's death was already a
global restart from the last checkpoint (see ``_actor_watch``), so the run recovers the same way; the watch names
the other key in the report of a death (a fault that kills ``weights`` or ``health_monitor`` kills both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from relax_services._health_monitor import HealthMonitor
from relax_services.weights import RayWeightStore, WeightStoreActor

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["WeightsAndMonitor", "create_weights_and_monitor"]


class WeightsAndMonitor(WeightStoreActor, HealthMonitor):
    """Body of the Ray actor that is both the run's policy weight store and its heartbeat collector.

    Args:
        keep: Versions whose objects the store keeps referenced (:class:`~relax_services.weights.WeightStoreActor`).
    """

    def __init__(self, keep: int = 2) -> None:
        WeightStoreActor.__init__(self, keep)
        HealthMonitor.__init__(self)


def create_weights_and_monitor(name: str, keep: int = 2) -> tuple[RayWeightStore, ActorHandle[WeightsAndMonitor]]:
    """Start the named actor (``num_cpus=0``); returns the weight store over it and its handle as the health monitor.

    Args:
        name: The actor's Ray name.
        keep: Versions the store keeps.
    """
    import ray

    # ray's stubs widen a class's handle (see RayWeightStore.create); the store sees the same actor by its face.
    actor = cast(
        "ActorHandle[WeightsAndMonitor]", ray.remote(WeightsAndMonitor).options(name=name, num_cpus=0).remote(keep)
    )
    return RayWeightStore(cast("ActorHandle[WeightStoreActor]", actor)), actor
