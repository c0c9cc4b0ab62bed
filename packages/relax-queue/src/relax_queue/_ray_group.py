"""Several named queues in one Ray actor process: :func:`create_ray_queues`.

A Ray worker process costs tens of MB before it holds a row (``import ray`` and what Ray's serialisation imports),
so a pipeline whose queues are light can keep them in one process. The group actor holds one queue server per
name (the very body a single queue's actor has) and takes every call with the queue's name first; a
:class:`~relax_queue._ray.RayQueueClient` with ``queue`` set puts that name in front of each call it makes, so the
clients' API is the single queue's.
"""

from __future__ import annotations

from collections.abc import Mapping

from relax_queue._config import QueueConfig
from relax_queue._ray import (
    DEFAULT_OBJECT_STORE_CHUNK_BYTES,
    DEFAULT_OBJECT_STORE_THRESHOLD,
    RayQueueClient,
    actor_options,
)
from relax_queue._ray_actor import group_actor_class, ray_module

__all__ = ["create_ray_queues"]


def create_ray_queues(
    name: str,
    configs: Mapping[str, QueueConfig],
    *,
    namespace: str | None = None,
    detached: bool = False,
    object_store_threshold: int = DEFAULT_OBJECT_STORE_THRESHOLD,
    object_store_chunk_bytes: int = DEFAULT_OBJECT_STORE_CHUNK_BYTES,
    durable_payloads: bool = True,
    opaque_values: bool = True,
    pipeline_puts: bool = False,
    host: type | None = None,
    host_args: tuple[object, ...] = (),
) -> dict[str, RayQueueClient]:
    """Start one actor (once per cluster) that holds several named queues; returns a client of each, by name.

    Each queue is what :func:`create_ray_queue` would make of its config (its own rows, leases, versions and
    snapshots); they share one process and one event loop, which saves a Ray worker process per queue (tens of MB
    of imports each) where the queues are light. Their fates are shared too: the actor's death ends every queue in
    it, and :meth:`RayQueueClient.shutdown` of any client kills the actor. Arguments as :func:`create_ray_queue`'s;
    ``configs`` maps each queue's name to its config. ``host`` (a plain class, built with ``host_args``) is other
    light state the same process serves: the actor has its methods too, called through any client's ``actor``
    handle (e.g. a pipeline's weight registry and heartbeat collector; see :func:`group_actor_class`).

    Raises:
        ValueError: an actor of that name already exists, ``configs`` is empty, or ``host`` has a method of the
            queue actor's name.
    """
    if not configs:
        raise ValueError("create_ray_queues needs at least one queue config")
    ray = ray_module()
    options = actor_options(name, namespace, detached)
    actor = group_actor_class(host).options(**options).remote(dict(configs), durable_payloads, *host_args)
    ray.get(actor.call.remote(next(iter(configs)), "metrics"))  # surface constructor errors here
    return {
        queue: RayQueueClient(
            actor,
            name,
            namespace,
            object_store_threshold,
            object_store_chunk_bytes,
            opaque_values,
            pipeline_puts,
            queue,
        )
        for queue in configs
    }
