"""The one launch sequence of a checked run config: `relax train`, `relax chaos` and `relax bench pipeline` run
their runs through :func:`launch`.

It picks the driver (:class:`~relax_services.control.controller.Controller` over Ray, or, with
``run.mode=colocated``, :class:`~relax_services.control.colocated.ColocatedController` in this process), starts or
joins Ray for a distributed run, runs the controller to its end and stops a Ray instance it started. Light: the
colocated driver (the model stack) is imported only for a colocated run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_services.config import RunConfig
    from relax_services.control.controller import Controller
    from relax_services.control.run_result import RunResult

__all__ = ["LaunchError", "launch"]


class LaunchError(Exception):
    """The run could not start: nothing ran (a colocated run one process cannot run, an unreachable cluster)."""


def launch(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    resume_changes: dict[str, tuple[object, object]] | None = None,
    started_at: float | None = None,
    on_start: Callable[[Controller], None] | None = None,
) -> RunResult:
    """Run ``cfg`` in the existing run folder ``run_dir`` and return its result.

    Args:
        cfg: A checked run config (:func:`~relax_services.control.preflight.check_run`).
        run_dir: The run folder (made by :func:`~relax_services.control.preflight.make_run_dir`).
        resume: Continue from the folder's last checkpoint.
        resume_changes: What the resume overrides changed (``key: (saved, new)``), recorded in the metrics.
        started_at: When the command started (``time.monotonic``), for the start-up split; None: now.
        on_start: Called with the controller once it is built, before it runs (e.g. to route signals to it).

    Raises:
        LaunchError: Before anything ran: a colocated run that one process cannot run
            (:func:`~relax_services.control.colocated.check_colocated`), or the Ray cluster at ``run.ray_address``
            cannot be reached.
    """
    from relax_services.control.controller import Controller
    from relax_services.hosting.ray_init import init_ray

    controller_cls: type[Controller] = Controller
    started = False
    if cfg.run.mode == "colocated":  # every service a thread of this process: no Ray
        from relax_services.control.colocated import ColocatedController, check_colocated

        try:
            check_colocated(cfg)
        except ValueError as exc:
            raise LaunchError(str(exc)) from exc
        controller_cls = ColocatedController
    else:
        try:
            started = init_ray(cfg.run.ray_address)  # False when this process already holds a Ray instance
        except ConnectionError as exc:
            raise LaunchError(str(exc)) from exc
    try:
        controller = controller_cls(cfg, run_dir, resume=resume, resume_changes=resume_changes, started_at=started_at)
        if on_start is not None:
            on_start(controller)
        return controller.run()
    finally:
        if started:
            import ray

            ray.shutdown()
