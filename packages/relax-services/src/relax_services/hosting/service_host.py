"""Service actors made from a light class: the driver names each service by import path, and only the actor's own
process imports it (with torch and transformers, for the services that run a model).

Ray builds an actor from the class it is given, importing that class's module in the driver first; the service
classes' modules import the model stack, so the driver would too. :class:`ServiceHost` is the class Ray sees: its
module imports nothing heavy, its constructor imports the service named by :data:`SERVICE_CLASSES` (or any
``"module:Class"`` path) inside the actor process and builds it there, and its methods forward the control
surface the controller and the health manager call (every service's, the Trainer's and the Evaluator's).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from relax_services.data.prompts import HeldoutReport
    from relax_services.services._base import ServiceBase, ServiceStatus

__all__ = ["SERVICE_CLASSES", "ServiceHost", "host_class", "service_class"]

SERVICE_CLASSES: dict[str, str] = {
    "trainer": "relax_services.services.trainer:TrainerService",
    "rollout": "relax_services.services.rollout:RolloutService",
    "reward": "relax_services.services.reward:RewardService",
    "reference": "relax_services.services.reference:ReferenceService",
    "critic": "relax_services.services.critic:CriticService",
    "eval": "relax_services.services.evaluator:EvalService",
}
"""Service role → ``"module:Class"`` of its service (imported where the service runs, never in the driver)."""


def service_class(target: str | type) -> type[ServiceBase]:
    """The service class ``target`` names: a ``"module:Class"`` path (imported now), or a class itself.

    Raises:
        ValueError: ``target`` is not ``"module:Class"``, or the module has no such class.
    """
    if isinstance(target, type):
        return cast("type[ServiceBase]", target)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"service class {target!r} is not 'module:Class'")
    cls = getattr(importlib.import_module(module_name), attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"service class {target!r}: module {module_name!r} has no class {attr!r}")
    return cast("type[ServiceBase]", cls)


class ServiceHost:
    """The Ray actor class of a service given by import path: builds the service in this (the actor's) process and
    forwards its control surface to it.

    Args:
        target: The service's ``"module:Class"`` (see :data:`SERVICE_CLASSES`).
        name: The service's name; ``args`` and ``kwargs`` follow it to the service's constructor.
    """

    def __init__(self, target: str, name: str, *args: object, **kwargs: object) -> None:
        build = cast("Callable[..., ServiceBase]", service_class(target))  # each service has its own signature
        self.service = build(name, *args, **kwargs)

    # ------------------------------------------------------------------ every service (ServiceBase)
    def start(self) -> int:
        """:meth:`ServiceBase.start`."""
        return self.service.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """:meth:`ServiceBase.stop` (the service's own override, where it has one)."""
        return self.service.stop(timeout)

    def rebuild(self, *args: object, **kwargs: object) -> int:
        """:meth:`ServiceBase.rebuild` with the service's constructor arguments (its name first)."""
        return self.service.rebuild(*args, **kwargs)

    def pid(self) -> int:
        """:meth:`ServiceBase.pid`."""
        return self.service.pid()

    def node_id(self) -> str:
        """:meth:`ServiceBase.node_id`."""
        return self.service.node_id()

    def status(self) -> ServiceStatus:
        """:meth:`ServiceBase.status`."""
        return self.service.status()

    def report(self) -> list[dict[str, object]]:
        """:meth:`ServiceBase.report`."""
        return self.service.report()

    def inject(self, kind: str) -> None:
        """:meth:`ServiceBase.inject` (the service's own kinds too, e.g. the Trainer's ``kill_rank``)."""
        self.service.inject(kind)

    # ------------------------------------------------------------------ role methods the controller calls
    def _role(self, method: str) -> Callable[..., object]:
        found = getattr(self.service, method, None)
        if not callable(found):
            raise AttributeError(f"service {type(self.service).__name__} has no method {method!r}")
        return cast("Callable[..., object]", found)

    def pause(self, timeout: float = 300.0) -> int:
        """The Trainer's ``pause``: hold between updates; returns the version held."""
        return cast("int", self._role("pause")(timeout))

    def resume(self) -> None:
        """The Trainer's ``resume``."""
        self._role("resume")()

    def save_engine(self, path: str) -> int:
        """The Trainer's ``save_engine``: its engine state to ``path``; returns the version."""
        return cast("int", self._role("save_engine")(path))

    def export_hf(self, checkpoint_dir: str) -> str:
        """The Trainer's ``export_hf``: the checkpoint's policy in Hugging Face format; returns the folder."""
        return cast("str", self._role("export_hf")(checkpoint_dir))

    def evaluate_latest(self) -> tuple[int, dict[str, float], list[dict[str, object]]]:
        """The Evaluator's ``evaluate_latest``: the newest weights' version, held-out reward and conversations."""
        return cast("tuple[int, dict[str, float], list[dict[str, object]]]", self._role("evaluate_latest")())

    def policy_version(self) -> int:
        """A Rollout's ``policy_version``: pulls the newest weights, returns the version it holds."""
        return cast("int", self._role("policy_version")())

    def heldout_report(self) -> HeldoutReport:
        """The Evaluator's ``heldout_report``: which held-out rows it kept and which it skipped, and why."""
        return cast("HeldoutReport", self._role("heldout_report")())


@functools.cache
def host_class(target: str) -> type[ServiceHost]:
    """A :class:`ServiceHost` subclass named after ``target``'s class (``"module:TrainerService"`` →
    ``TrainerService``), so that the actor's process title, Ray's dashboard and the run summary's memory split
    name the service, not the host. Made once per target (a restart creates the same class)."""
    name = target.rpartition(":")[2] or "ServiceHost"
    return type(name, (ServiceHost,), {"__module__": __name__, "__qualname__": name, "__doc__": ServiceHost.__doc__})
