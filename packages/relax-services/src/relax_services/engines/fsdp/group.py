"""The Trainer as a group of Ray actors forming one torch.distributed process group around
:class:`~relax_services.engines.FSDPTrainEngine`.

:class:`TrainerGroup` implements the :class:`~relax_services.engines.TrainEngine` protocol, so a service
drives ``world_size`` ranks as it drives one engine. Every call goes to every rank with the same arguments
(the batch is put in the object store once and read by each rank, which trains on its own share: no scatter
step, and rank 0 is no bottleneck); the call returns when every rank has, and rank 0's answer is the
group's.

Failures: ranks run collectives, so a rank that dies or hangs leaves the others blocked inside one. The group
therefore fails as a unit: the first rank error, a rank process that died, or a call that outlives
``step_timeout_s`` kills every rank and raises :class:`TrainerGroupFailed`. An update whose call failed has
produced no version and nothing to publish; the caller restarts a new group from the last checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, but not re-exported for mypy

from relax_parallel import ParallelConfig, ParallelPlan
from relax_services.engines.fsdp.train import FSDPConfig, FSDPTrainEngine
from relax_services.engines.progress import tick
from relax_services.engines.protocols import LossFn, LossInputs, LossResult, RankOptions, TrainSample
from relax_services.engines.scoring import TokenScores
from relax_services.engines.torch.train import TorchTrainConfig

__all__ = ["TrainerGroup", "TrainerGroupConfig", "TrainerGroupFailed"]

logger = logging.getLogger(__name__)

ModelFactory = Callable[[], torch.nn.Module]
"""Builds the model on a rank (every rank must build the same weights, e.g. from one seed or checkpoint). A factory
with an ``empty()`` method (:class:`~relax_services.models.policy.PolicyFactory`) is called on rank 0 only; the other
ranks build the empty model and receive rank 0's weights."""


@dataclass(frozen=True)
class TrainerGroupConfig:
    """Shape of the Trainer group.

    Attributes:
        world_size: Ranks (Ray actors, one process each) in the process group.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        step_timeout_s: A call not answered by every rank within this many seconds fails the group (a hung
            rank); also the process group's collective timeout.
        start_timeout_s: Seconds the ranks may take to start (import the model stack, build the model, join
            the process group) before the group fails.
        num_cpus_per_rank: Ray CPUs reserved per rank.
        num_gpus_per_rank: Ray GPUs reserved per rank (1 with NCCL).
        resource: A Ray custom resource every rank requires 0.01 of (``run.placement``'s pinning of the
            Trainer's role to chosen nodes); None: Ray places the ranks freely.
        parallel: relax-parallel's layout of the group, realised as each rank's ``DeviceMesh``
            (:meth:`relax_parallel.ParallelPlan.device_mesh`, the FSDP engine sharding over its ``dp``
            dimension, splitting the decoder blocks over ``tp`` and every sequence over ``cp``, Ulysses sequence
            parallelism); None: data-parallel over every rank (``dp = world_size``). Only ``dp``, ``cp`` and
            ``tp`` may exceed 1 (the engine has no pipeline or expert parallelism yet).
    """

    world_size: int = 2
    backend: Literal["gloo", "nccl"] = "gloo"
    step_timeout_s: float = 600.0
    start_timeout_s: float = 600.0
    num_cpus_per_rank: float = 1.0
    num_gpus_per_rank: float = 0.0
    resource: str | None = None
    parallel: ParallelConfig | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"TrainerGroupConfig.world_size must be >= 1, got {self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"TrainerGroupConfig.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.step_timeout_s <= 0:
            raise ValueError(f"TrainerGroupConfig.step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.start_timeout_s <= 0:
            raise ValueError(f"TrainerGroupConfig.start_timeout_s must be > 0, got {self.start_timeout_s}")
        layout = self.layout
        others = {d: getattr(layout, d) for d in ("pp", "ep") if getattr(layout, d) != 1}
        if others or layout.world_size != self.world_size:
            raise ValueError(
                f"TrainerGroupConfig.parallel must be data-, sequence- (cp) and tensor-parallel over the world_size="
                f"{self.world_size} ranks (dp × cp × tp = {self.world_size}, pp = ep = 1), got {layout.short()}"
            )

    @property
    def layout(self) -> ParallelConfig:
        """The group's parallel layout (``parallel``, or data-parallel over every rank)."""
        return self.parallel if self.parallel is not None else ParallelConfig(dp=self.world_size)


class TrainerGroupFailed(RuntimeError):
    """A rank of the Trainer group failed, died or hung; every rank has been stopped."""


class _TrainerRank:
    """Body of one rank's Ray actor: joins the process group and owns that rank's engine."""

    def __init__(self, rank: int, group: TrainerGroupConfig) -> None:
        from relax_services.engines._threads import configure_process

        configure_process()
        self.rank = rank
        self.group = group
        self._store: TCPStore | None = None
        self._die_in_next_step = False
        self.engine: FSDPTrainEngine

    def open_store(self) -> str:
        """Rank 0: the rendezvous store on a port the OS picks while binding it (a port chosen first and bound
        later could be taken by another process in between); returns its ``host:port``."""
        import ray

        host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        self._store = TCPStore(
            host, 0, self.group.world_size, is_master=True, timeout=self._timeout, wait_for_workers=False
        )
        return f"{host}:{self._store.port}"

    def join(
        self,
        address: str,
        model_factory: ModelFactory,
        config: TorchTrainConfig,
        fsdp: FSDPConfig,
        reference_factory: ModelFactory | None = None,
    ) -> str:
        """Join the process group through rank 0's store at ``address`` and build this rank's engine (with its own
        copy of the full KL's reference, built by ``reference_factory``); returns the plan text read back from the
        mesh it built (:func:`~relax_services.engines.trainer_plan.realised_plan_text`)."""
        from relax_services.engines.trainer_plan import realised_plan_text

        if self.group.backend == "nccl":  # Ray made this rank's GPUs its visible devices: the first is its own
            torch.cuda.set_device(0)
        if self._store is None:
            host, _, port = address.rpartition(":")
            self._store = TCPStore(host, int(port), self.group.world_size, is_master=False, timeout=self._timeout)
        dist.init_process_group(
            self.group.backend,
            store=self._store,
            rank=self.rank,
            world_size=self.group.world_size,
            timeout=self._timeout,
        )
        plan = ParallelPlan.from_config(self.group.layout, service="trainer")
        mesh = plan.device_mesh("cuda" if self.group.backend == "nccl" else "cpu")
        tp_mesh = mesh["tp"] if self.group.layout.tp > 1 else None
        sp_mesh = mesh["cp"] if self.group.layout.cp > 1 else None
        # Rank 0 alone loads the checkpoint when the factory can build an empty model: the others receive its weights.
        empty = getattr(model_factory, "empty", None)
        model = empty() if self.rank != 0 and callable(empty) else model_factory()
        reference = reference_factory() if reference_factory is not None and config.full_kl else None
        self.engine = FSDPTrainEngine(
            model, config, fsdp, mesh=mesh["dp"], tp_mesh=tp_mesh, reference=reference, sp_mesh=sp_mesh
        )
        return realised_plan_text(self.group.layout, self.group.backend, mesh)

    @property
    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.group.step_timeout_s)

    def pid(self) -> int:
        return os.getpid()

    def arm_kill(self) -> None:
        """Fault injection: this rank's process dies (SIGKILL) in its first loss call of the next update, while
        the other ranks are inside that update's collectives."""
        self._die_in_next_step = True

    def step(self, batch: Sequence[TrainSample], loss_fn: LossFn) -> dict[str, float]:
        if self._die_in_next_step:
            loss_fn = _dying(loss_fn)
        return self.engine.step(batch, loss_fn)

    def compute_logprobs(self, batch: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.engine.compute_logprobs(batch)

    def compute_scores(self, batch: Sequence[TrainSample]) -> TokenScores:
        return self.engine.compute_scores(batch)

    def policy_state(self) -> dict[str, torch.Tensor] | None:
        state = self.engine.policy_state(keep=self.rank == 0)  # every rank gathers; rank 0 alone keeps a copy
        return state if self.rank == 0 else None

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        state = self.engine.adapter_state()  # collective: every rank gathers the adapters
        return state if self.rank == 0 else None

    def full_state(self) -> dict[str, Any] | None:
        state = self.engine.full_state_dict()  # every rank gathers; rank 0 alone gets the entries
        return state if self.rank == 0 else None

    def load_full_state(self, state: Mapping[str, Any]) -> None:
        self.engine.load_full_state_dict(state)

    def save_checkpoint(self, folder: str) -> None:
        from relax_services.engines.fsdp.checkpoint import save_checkpoint

        save_checkpoint(self.engine, Path(folder))

    def load_checkpoint(self, folder: str) -> int:
        from relax_services.engines.fsdp.checkpoint import load_checkpoint

        load_checkpoint(self.engine, Path(folder))
        return self.engine.version


class TrainerGroup:
    """:class:`~relax_services.engines.TrainEngine` over ``world_size`` Ray actors training one sharded model.

    Needs a running Ray (``ray.init``). Rendezvous: rank 0 opens a ``TCPStore`` on a port the OS assigns it
    and the group hands that address to the other ranks.

    Args:
        model_factory: Builds each rank's model (picklable).
        config: Optimizer and loss settings of every rank's engine.
        fsdp: Sharding settings.
        group: World size, backend, timeout and resources.
        placement: Where each rank goes (its GPUs and placement-group bundle, which override
            ``group.num_gpus_per_rank``); None: Ray places the ranks by ``group``'s resources.
        reference_factory: With ``config.full_kl``, builds each rank's frozen reference (the initial checkpoint,
            picklable); None: each rank copies the model it builds (which rank 0's meta-device peers cannot).
    """

    def __init__(
        self,
        model_factory: ModelFactory,
        config: TorchTrainConfig | None = None,
        fsdp: FSDPConfig | None = None,
        group: TrainerGroupConfig | None = None,
        placement: RankOptions | None = None,
        reference_factory: ModelFactory | None = None,
    ) -> None:
        import ray

        self.group = group or TrainerGroupConfig()
        resources = {} if self.group.resource is None else {self.group.resource: 0.01}
        actor = ray.remote(
            num_cpus=self.group.num_cpus_per_rank,
            num_gpus=self.group.num_gpus_per_rank,
            resources=resources,
            max_restarts=0,
        )(_TrainerRank)
        self._ranks: list[Any] = [
            actor.options(**({} if placement is None else placement.options(r))).remote(r, self.group)
            for r in range(self.group.world_size)
        ]
        self._failed: str | None = None
        self._version = 0
        start = self.group.start_timeout_s
        address = str(self._call("open_store", timeout_s=start, ranks=1)[0])
        train, shard = config or TorchTrainConfig(), fsdp or FSDPConfig()
        joined = self._call("join", address, model_factory, train, shard, reference_factory, timeout_s=start)
        self.plan_text: str = str(joined[0])
        """The layout this group realised, as rank 0 read it back from its ``DeviceMesh`` and process groups (the
        text ``relax plan`` prints for the run config that built the group)."""
        logger.info("trainer group started:\n%s", self.plan_text)

    @property
    def alive(self) -> bool:
        """False once a rank has failed (the group is then stopped for good)."""
        return self._failed is None

    @property
    def version(self) -> int:
        """Policy updates applied by the whole group."""
        return self._version

    def step(self, batch: Sequence[TrainSample], loss_fn: LossFn) -> dict[str, float]:
        """One update on every rank; its version exists only once every rank has finished it.

        Raises:
            TrainerGroupFailed: A rank failed, died or hung in it (the message names the update, version + 1).
        """
        import ray

        update = f"update {self._version + 1}"
        metrics: dict[str, float] = self._call("step", ray.put(list(batch)), loss_fn, what=update)[0]
        self._version += 1
        return metrics

    def compute_logprobs(self, batch: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and mask of the batch, every rank scoring its share (rank 0's gathered answer)."""
        import ray

        result: tuple[torch.Tensor, torch.Tensor] = self._call("compute_logprobs", ray.put(list(batch)))[0]
        return result

    def compute_scores(self, batch: Sequence[TrainSample]) -> TokenScores:
        """Per-token log-probs, entropy and mask of the batch, every rank scoring its share (rank 0's gathered
        answer)."""
        import ray

        scores: TokenScores = self._call("compute_scores", ray.put(list(batch)))[0]
        return scores

    def policy_state(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The full weights (gathered by every rank, returned by rank 0: a copy whatever ``copy`` says)."""
        state: dict[str, torch.Tensor] = self._call("policy_state")[0]
        return state

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """With ``model.lora``: the adapters alone, full tensors under the adapted model's names (rank 0's gathered
        copy), what the Trainer publishes for LoRA requests (``rollout.vllm.lora_requests``)."""
        state: dict[str, torch.Tensor] = self._call("adapter_state")[0]
        return state

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """Full (unsharded) model, optimizer (keyed by parameter name), scheduler, rank 0's RNG and version (gathered
        copies whatever ``copy`` says): a
        checkpoint any world size of the group loads. :mod:`~relax_services.engines.fsdp.checkpoint` writes the
        sharded form instead, for models too large to gather."""
        state: dict[str, Any] = self._call("full_state")[0]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Loads a `state_dict` (of any world size) into every rank and takes its version."""
        import ray

        self._call("load_full_state", ray.put(dict(state)))
        self._version = int(state["version"])

    def save_checkpoint(self, folder: Path) -> None:
        """Writes the sharded checkpoint of :func:`~relax_services.engines.fsdp.checkpoint.save_checkpoint`
        (every rank its shards; ``folder`` must be on a file system every rank sees)."""
        self._call("save_checkpoint", str(folder))

    def load_checkpoint(self, folder: Path) -> None:
        """Restores a sharded checkpoint saved by a group of any world size."""
        self._version = int(self._call("load_checkpoint", str(folder))[0])

    def rank_pids(self) -> list[int]:
        """Process id of every rank, in rank order."""
        return [int(pid) for pid in self._call("pid")]

    def arm_kill(self, rank: int) -> None:
        """Fault injection: ``rank``'s process dies inside the next update (the group then fails as a unit)."""
        import ray

        if not 0 <= rank < self.group.world_size:
            raise ValueError(f"rank {rank} is not in a group of world_size {self.group.world_size}")
        ray.get(self._ranks[rank].arm_kill.remote(), timeout=self.group.step_timeout_s)

    def shutdown(self) -> None:
        """Stops every rank."""
        import ray

        for actor in self._ranks:
            ray.kill(actor)
        self._ranks = []

    def _call(
        self, method: str, *args: object, timeout_s: float | None = None, what: str = "", ranks: int | None = None
    ) -> list[Any]:
        """``method(*args)`` on every rank (or the first ``ranks``); the answers in rank order. Fails the group on
        the first rank error, a dead rank, or no complete answer within ``timeout_s`` (default
        ``step_timeout_s``); ``what`` names the call in the failure's message."""
        import ray

        if self._failed is not None:
            raise TrainerGroupFailed(f"the trainer group has failed earlier ({self._failed}); start a new one")
        refs = [getattr(actor, method).remote(*args) for actor in self._ranks[:ranks]]
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        deadline = time.monotonic() + (self.group.step_timeout_s if timeout_s is None else timeout_s)
        label = f"{method} ({what})" if what else method
        while pending:
            # Polled each second: the service's progress ticks while the ranks work within the group's own deadline.
            wait_s = min(1.0, max(0.0, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not ready:
                if time.monotonic() < deadline:
                    tick()
                    continue
                self._fail(f"ranks {sorted(rank_of[r] for r in pending)} did not finish {label} in time")
            try:
                ray.get(ready[0])
            except Exception as exc:  # a rank's own error or its process's death: either way the group is broken
                self._fail(f"rank {rank_of[ready[0]]} failed in {label}: {type(exc).__name__}: {exc}")
        return list(ray.get(refs))

    def _fail(self, reason: str) -> None:
        self._failed = reason
        self.shutdown()  # the other ranks are blocked in a collective with the broken one
        raise TrainerGroupFailed(reason)


def _dying(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` whose first call kills this process (SIGKILL: no cleanup, as a crash or the OOM killer)."""

    def die(inputs: LossInputs) -> torch.Tensor | tuple[torch.Tensor, Mapping[str, float]] | LossResult:
        os.kill(os.getpid(), signal.SIGKILL)
        return loss_fn(inputs)

    return die
