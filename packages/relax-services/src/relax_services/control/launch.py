"""The one launch sequence of a checked run config: `relax train`, `relax chaos` and `relax bench pipeline` run
their runs through :func:`launch`.

It picks the driver (:class:`~relax_services.control.controller.Controller` over Ray, or, with
``run.mode=colocated``, :class:`~relax_services.control.colocated.ColocatedController` in this process), starts or
joins Ray for a distributed run, runs the controller to its end and stops a Ray instance it started. Light: the
colocated driver (the model stack) is imported only for a colocated run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from relax_services.config.threads import with_threads

if TYPE_CHECKING:
    from relax_services.config import RunConfig
    from relax_services.control.controller import Controller
    from relax_services.control.run_result import RunResult

__all__ = ["LaunchError", "launch", "machine_cores", "resolve_devices"]

logger = logging.getLogger(__name__)


class LaunchError(Exception):
    """The run could not start: nothing ran (a colocated run one process cannot run, an unreachable cluster, devices
    the cluster does not have)."""


def resolve_devices(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``run.device`` resolved against the GPUs there are (Ray's cluster for a distributed run, which
    must be up; this process's torch for a colocated one), and a distributed run's GPU processes checked against
    them (:func:`~relax_services.hosting.placement.check_cluster`).

    ``run.device=auto`` is ``cuda`` when there are GPUs and the run's processes fit them, else ``cpu`` (with a
    warning naming why).

    Raises:
        LaunchError: ``run.device=cuda`` without a GPU, more GPUs asked than the cluster has, or a Trainer group
            sharing GPUs between ranks (the message names the fields and what Ray reports).
    """
    from relax_services.config.devices import DeviceError, resolve_device, with_device
    from relax_services.hosting.placement import check_cluster, run_processes

    if cfg.run.mode == "colocated":
        import torch

        gpus, source = float(torch.cuda.device_count()), "torch in this process"
    else:
        import ray

        gpus, source = float(ray.cluster_resources().get("GPU", 0.0)), "Ray"  # type: ignore[no-untyped-call]
    try:
        resolved = with_device(cfg, resolve_device(cfg.run.device, gpus, source=source))
        if cfg.run.mode != "colocated":
            check_cluster(resolved, run_processes(resolved), gpus)
    except DeviceError as exc:
        if cfg.run.device != "auto":
            raise LaunchError(str(exc)) from exc
        # auto: a run the GPUs cannot hold (the default run asks for 2, a machine may have 1) trains on the CPU
        logger.warning("run.device=auto: %s; the run trains on the CPU (set run.device=cuda to insist)", exc)
        resolved = with_device(cfg, "cpu")
    return resolved


def machine_cores(cfg: RunConfig) -> int:
    """The cores of one machine of the run: this process's (its CPU affinity) for a colocated run, the smallest
    node's CPUs in the Ray cluster (which must be up) for a distributed one."""
    if cfg.run.mode == "colocated":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    import ray

    cpus = [node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node.get("Alive")]  # type: ignore[no-untyped-call]
    return max(1, int(min(cpus, default=1.0)))


def launch(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    resume_changes: dict[str, tuple[object, object]] | None = None,
    started_at: float | None = None,
    on_start: Callable[[Controller], None] | None = None,
    on_resolved: Callable[[RunConfig], None] | None = None,
) -> RunResult:
    """Run ``cfg`` in the existing run folder ``run_dir`` and return its result.

    Args:
        cfg: A checked run config (:func:`~relax_services.control.preflight.check_run`).
        run_dir: The run folder (made by :func:`~relax_services.control.preflight.make_run_dir`).
        resume: Continue from the folder's last checkpoint.
        resume_changes: What the resume overrides changed (``key: (saved, new)``), recorded in the metrics.
        started_at: When the command started (``time.monotonic``), for the start-up split; None: now.
        on_start: Called with the controller once it is built, before it runs (e.g. to route signals to it).
        on_resolved: Called with the config the run runs, its device resolved (:func:`resolve_devices`), before any
            service starts (e.g. to print the Trainer's plan).

    Raises:
        LaunchError: Before anything ran: a colocated run that one process cannot run
            (:func:`~relax_services.control.colocated.check_colocated`), the Ray cluster at ``run.ray_address``
            cannot be reached, the devices asked are not there (:func:`resolve_devices`), or
            ``trainer.engine=fsdp`` with a torch whose FSDP2 lacks what the engine calls.
    """
    from relax_services.control.controller import Controller
    from relax_services.hosting.ray_init import init_ray

    controller_cls: type[Controller] = Controller
    started = False
    if cfg.trainer.engine == "fsdp":  # here, once and before Ray starts, not by each rank as the group is built
        from relax_services.engines.fsdp.train import fsdp2_lacks

        why = fsdp2_lacks()
        if why is not None:
            raise LaunchError(why)
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
        cfg = with_threads(resolve_devices(cfg), machine_cores(cfg))
        if on_resolved is not None:
            on_resolved(cfg)
        controller = controller_cls(cfg, run_dir, resume=resume, resume_changes=resume_changes, started_at=started_at)
        if on_start is not None:
            on_start(controller)
        return controller.run()
    finally:
        if started:
            import ray

            ray.shutdown()
