"""Several services in one Ray actor process (``run.hosts``): the host actor, the per-service handles that address
one service inside it, and the record of a host's members that a restart brings back together.

Each process that runs a model holds ≈ 400 MB of imports (torch, transformers) before any work, so hosting roles
together is what the default distributed run's memory needs. The services of a host are the same service objects as
in their own actors, each with its own work-loop thread over the same queue and weight-store clients (as the
colocated mode runs them), so an exception in one role stays that role's: the health manager rebuilds it inside the
host. The host's process is their one failure domain: when it dies, hangs in a role, or cannot rebuild a role, every
role it held is restarted in a new one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relax_services.hosting.service_host import ServiceHost

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from relax_services.control.pipeline import ServiceSpec

__all__ = ["HostedHandle", "ServiceGroupHost", "SharedHost", "actor_options", "group_class"]

_CALLS_PER_SERVICE = 4
"""Concurrent actor calls each service may have in flight, in its own actor or in a host: the
controller's report polls, the Trainer's pause, the Evaluator's evaluation and a rebuild must not queue behind each
other's."""

MemberArgs = tuple[str, str, tuple[Any, ...], dict[str, Any]]
"""``(service name, "module:Class", positional args after the name, keyword args)`` of one hosted service."""


class ServiceGroupHost:
    """The Ray actor class of a host: builds each member service in this process (imported here, not in the
    driver) and forwards calls to one of them by name.

    Args:
        members: Each service's name, class path and constructor arguments (see :data:`MemberArgs`).
    """

    def __init__(self, members: list[MemberArgs]) -> None:
        self.hosts = {name: ServiceHost(target, name, *args, **kwargs) for name, target, args, kwargs in members}

    def call(self, service: str, method: str, /, *args: object, **kwargs: object) -> object:
        """``method(*args, **kwargs)`` of member ``service``'s control surface (:class:`ServiceHost`'s methods).

        Raises:
            KeyError: ``service`` is not a member of this host.
            AttributeError: ``method`` is not a public method of the control surface.
        """
        host = self.hosts.get(service)
        if host is None:
            raise KeyError(f"service {service!r} is not hosted here; members: {', '.join(self.hosts)}")
        if method.startswith("_") or not callable(getattr(ServiceHost, method, None)):
            raise AttributeError(f"hosted service {service!r} has no control method {method!r}")
        return getattr(host, method)(*args, **kwargs)


class _HostedMethod:
    """``handle.<method>.remote(...)`` of one hosted service: a :meth:`ServiceGroupHost.call` of its host."""

    def __init__(self, actor: ActorHandle[ServiceGroupHost], service: str, method: str) -> None:
        self._actor = actor
        self._service = service
        self._method = method

    def remote(self, *args: object, **kwargs: object) -> ObjectRef[object]:
        """Call the method in the host; returns the call's Ray object reference."""
        ref: ObjectRef[object] = self._actor.call.remote(self._service, self._method, *args, **kwargs)
        return ref


class HostedHandle:
    """Stands for one service's actor handle where the service shares a host: ``handle.report.remote()`` calls the
    service's ``report`` inside the host, so the controller and the health manager call a hosted service as they
    call one in its own actor. ``actor`` is the host's real Ray handle (what ``ray.kill`` takes)."""

    def __init__(self, actor: ActorHandle[ServiceGroupHost], service: str) -> None:
        self.actor = actor
        self.service = service

    def __getattr__(self, method: str) -> _HostedMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _HostedMethod(self.actor, self.service, method)


def actor_options(name: str, services: int, resource: str | None) -> dict[str, object]:
    """Ray options of the actor whose process runs ``services`` services (its own service's, or a host's): named,
    no CPU reservation (the services pace themselves), :data:`_CALLS_PER_SERVICE` concurrent calls per service, never
    restarted by Ray (the health manager restarts services), on a node with ``resource`` when one is pinned."""
    options: dict[str, object] = {
        "name": name,
        "num_cpus": 0,
        "max_concurrency": _CALLS_PER_SERVICE * services,
        "max_restarts": 0,
    }
    if resource is not None:
        options["resources"] = {resource: 0.01}
    return options


def group_class(targets: list[str]) -> type[ServiceGroupHost]:
    """A :class:`ServiceGroupHost` subclass named after its services' classes (``RolloutService_EvalService``), so
    that the process title and the run summary's memory split say which roles share the process."""
    name = "_".join(target.rpartition(":")[2] for target in targets) or "ServiceGroupHost"
    return type(
        name, (ServiceGroupHost,), {"__module__": __name__, "__qualname__": name, "__doc__": ServiceGroupHost.__doc__}
    )


@dataclass
class SharedHost:
    """The services that share one process, and that process's actor (None until spawned).

    ``restarts`` counts the new processes the host was given after its first (each one restarts every member): the
    host's own count against ``health.max_restarts`` (see :mod:`relax_services.faults.restart_counts`).
    """

    name: str
    members: list[ServiceSpec]
    resource: str | None = None
    actor: Any = None
    restarts: int = 0
    placement: dict[str, object] = field(default_factory=dict)
    """Ray options placing the host on a GPU run (its GPUs and placement-group bundle); empty on a CPU run."""

    def spawn(self, namespace: str) -> None:
        """Create the host actor (its process imports and builds every member) and point each member's handle at
        it; no work loop starts yet."""
        import ray

        targets = [str(spec.cls) for spec in self.members]
        options = actor_options(f"{namespace}-{self.name}-{self.restarts}", len(self.members), self.resource)
        options |= self.placement
        members: list[MemberArgs] = [(spec.name, str(spec.cls), spec.args, spec.kwargs) for spec in self.members]
        self.actor = ray.remote(group_class(targets)).options(**options).remote(members)
        for spec in self.members:
            spec.handle = HostedHandle(self.actor, spec.name)
            spec.pid = None

    def kill(self) -> None:
        """End the host's process (every member with it); harmless when it is gone already."""
        import ray

        if self.actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)

    def replace(self, namespace: str) -> None:
        """Kill the host and spawn a new one with the same members (their work loops not started yet)."""
        self.kill()
        self.restarts += 1
        self.spawn(namespace)
