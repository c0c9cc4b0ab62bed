"""The run config's run and fault sections: where a run writes, how its services are placed and grouped into
processes (``run``), and the faults it injects (``faults``). Exported by :mod:`relax_services.config`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pydantic

from relax_core import ConfigModel
from relax_services.config.devices import DeviceChoice
from relax_services.config.hosts import DEFAULT_HOSTS, check_hosts, check_hosts_placement

__all__ = ["ACTOR_TARGETS", "FaultSpec", "RunSettings"]

ACTOR_TARGETS = ("prompt_queue", "sample_queue", "weights", "critic_weights", "health_monitor")
"""The actors of a pipeline that are not services (no work loop, no heartbeat) and that faults can kill: the two
queues, the policy and critic weight stores, and the health monitor. The two queues share one process, and so do the
policy store and the monitor: a kill of one key of a pair ends both (see ``_actor_watch``)."""


class FaultSpec(ConfigModel):
    """One injected fault (for tests and ``relax chaos``)."""

    service: Literal[
        "rollout",
        "reward",
        "reference",
        "critic",
        "eval",
        "trainer",
        "prompt_queue",
        "sample_queue",
        "weights",
        "critic_weights",
        "health_monitor",
    ]
    """Which service (a role: ``eval`` is the Evaluator), or which of the pipeline's other actors
    (:data:`ACTOR_TARGETS`: a queue, a weight store, the health monitor), to hit."""

    kind: Literal["kill", "raise", "hang", "break", "kill_rank"] = "kill"
    """SIGKILL its process, raise inside its work loop, or hang its work loop; ``break``: raise inside its work
    loop and leave its process unable to rebuild it (the rebuild raises, as a constructor failing in a damaged
    process would), so that only a new process brings it back (distributed mode only); ``kill_rank`` (the Trainer
    with ``trainer.world_size`` > 1): the last rank's process dies inside the next update. An actor target has no
    work loop: ``kill`` only."""

    replica: int | None = pydantic.Field(default=None, ge=0)
    """With ``service: rollout``: the Rollout replica to hit (``rollout-{replica}``, below ``rollout.replicas``);
    None: the first."""

    at_step: int = pydantic.Field(default=5, ge=0)
    """Inject once the trainer has reached this version."""

    min_trainer_backlog: int = pydantic.Field(default=0, ge=0)
    """And only once at least this many complete sample rows (every field the trainer reads present) wait for the
    trainer (e.g. a whole update's worth, so that the outage of a producer overlaps work the trainer can still
    consume); 0: no condition."""

    during_restart: bool = False
    """Inject during the first global restart that begins once the trainer has reached ``at_step``: right after
    the new pipeline's queues are restored from the checkpoint and its stores exist, before its services start
    (where Ray's memory monitor once killed the queue actors). An actor target only."""

    @pydantic.model_validator(mode="after")
    def _actor_faults(self) -> FaultSpec:
        actor = self.service in ACTOR_TARGETS
        if actor and self.kind != "kill":
            raise ValueError(
                f"fault on {self.service}: an actor without a work loop can only be killed (kind=kill), "
                f"got kind={self.kind}"
            )
        if self.replica is not None and self.service != "rollout":
            raise ValueError(
                f"fault on {self.service}: replica={self.replica} names a Rollout replica (with service: rollout)"
            )
        if self.during_restart and not actor:
            raise ValueError(
                f"fault on {self.service}: during_restart applies to {', '.join(ACTOR_TARGETS)} only "
                "(a global restart starts the services after it)"
            )
        return self


class RunSettings(ConfigModel):
    """Where the run writes and how it shows progress."""

    output_dir: Path = Path("runs")
    """Parent folder of run folders."""

    name: str | None = None
    """Run folder name (default: a timestamp)."""

    ray_address: str | None = None
    """Join an existing Ray cluster at this address instead of starting a local one."""

    mode: Literal["distributed", "colocated"] = "distributed"
    """'distributed': one Ray actor per service (several processes, GPUs, nodes). 'colocated': every service as a
    thread of the ``relax train`` process over the in-process queue and weight store (one machine, no Ray)."""

    device: DeviceChoice = "auto"
    """Where the roles that run a model compute: ``cuda`` (each reserves its GPUs: ``trainer.gpus_per_rank``,
    ``rollout.gpus``, ``reference.gpus``, ``critic.gpus``, ``eval.gpus``), ``cpu``, or ``auto``: ``cuda`` when the
    Ray cluster reports GPUs (this machine's torch in ``run.mode=colocated``). Resolved once at launch; asking for
    ``cuda``, or for more GPUs than the cluster has, is an error before anything starts."""

    threads: int | None = pydantic.Field(default=None, ge=1)
    """Torch intra-op threads of every process that computes (each engine pins it at every call; the colocated mode's
    one process too). Unset: resolved at launch to the machine's cores divided among the services that compute at
    once (Trainer ranks, rollout workers, the Evaluator, the Reference and the Critic when the algorithm has them),
    at least 1. A process's count changes the last bits of CPU reductions, so every process of a run uses one count;
    an engine built outside a launch computes with 1."""

    reuse_weight_buffers: bool = False
    """``run.mode=colocated``: write each published version into the buffers of the version that last left the weight
    store once no reader holds them, instead of a fresh allocation (whose first touch of every page costs 4–5× a
    plain copy on the CPU). Publishing then takes about one plain copy, but the spare is one more copy of the weights
    resident through the training step, where the process peaks (SmolLM2-135M: +0.5 GB). Off: memory first."""

    progress: Literal["auto", "live", "lines", "none"] = "auto"
    """'live' redraws a table (TTY), 'lines' prints one line per report, 'auto' picks by TTY."""

    report_every_s: float = pydantic.Field(default=5.0, gt=0.0)
    """Seconds between progress reports."""

    placement: dict[str, str] = pydantic.Field(default_factory=dict)
    """Pin roles to nodes: role (trainer, rollout, reward, reference, eval) → a Ray custom resource that only the
    chosen nodes have (each actor of the role requires 0.01 of it). Empty: Ray places actors freely."""

    hosts: list[list[str]] = pydantic.Field(default_factory=lambda: [list(host) for host in DEFAULT_HOSTS])
    """Distributed mode: roles whose services share one process (each list, two roles or more, is one Ray actor
    that runs them as threads over the same queue and weight-store clients; roles not listed have a process each,
    ``[]`` gives every service its own). A role stands for all its services, except that only the first Rollout
    replica (``rollout-0``) joins a host: every further replica has a process of its own. An exception in
    one role restarts that role inside its host; the death of the host, a hang, or a role that cannot be rebuilt
    inside it restarts every role it held in a new process (a global restart when the Trainer is one of them).
    Default: the Reference, the Evaluator and the Reward in the Rollout's process. The colocated mode runs every
    role in its one process whatever this says."""

    @pydantic.field_validator("hosts")
    @classmethod
    def _check_hosts(cls, value: list[list[str]]) -> list[list[str]]:
        return check_hosts(value)

    @pydantic.model_validator(mode="after")
    def _hosts_on_one_node(self) -> RunSettings:
        check_hosts_placement(self.hosts, self.placement)
        return self
