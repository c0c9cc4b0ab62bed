"""ParallelPlan: a chosen layout with its predictions, explanation and realisation."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relax_parallel._config import ParallelConfig
from relax_parallel._memory import GIB, MemoryBreakdown
from relax_parallel._strategy import ModalityStrategy
from relax_parallel._time import GenerationEstimate, TimeBreakdown

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Rank order shared by device_mesh() and megatron-core: tp varies fastest, then cp, dp, pp, matching
# megatron-core's default order "tp-cp-ep-dp-pp" (ep is carved out of cp·dp for expert layers).
MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")
EXPERT_MESH_DIMS: tuple[str, ...] = ("pp", "edp", "ep", "tp")
MEGATRON_ORDER = "tp-cp-ep-dp-pp"


@dataclass(frozen=True)
class ParallelPlan:
    """One service's layout with predicted memory, step time and the reasons behind it.

    Attributes:
        service: trainer, rollout, reference or critic.
        config: The parallel degrees and switches.
        memory: Predicted bytes per GPU on the most loaded stage, for the modality that binds.
        memory_limit: Usable bytes per GPU.
        binding_modality: Modality whose longest sequence sets the memory figure.
        time: Step-time breakdown (training and scoring services).
        generation: Rollout estimate (rollout service).
        binding_constraint: What limits the plan, in words.
        explanation: One line per choice, saying why.
        modalities: Per-modality treatment.
        encoder_placement: Where each encoder lives.
    """

    service: str
    config: ParallelConfig
    memory: MemoryBreakdown
    memory_limit: float
    binding_modality: str
    time: TimeBreakdown | None
    generation: GenerationEstimate | None
    binding_constraint: str
    explanation: tuple[str, ...]
    modalities: tuple[ModalityStrategy, ...] = ()
    encoder_placement: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: ParallelConfig, service: str = "trainer") -> ParallelPlan:
        """Wrap a layout chosen elsewhere (no predictions) so it can be realised.

        Args:
            config: The layout.
            service: Service name to record.

        Returns:
            A plan whose memory and time are empty and whose explanation says it was given.
        """
        return cls(
            service=service,
            config=config,
            memory=MemoryBreakdown(),
            memory_limit=0.0,
            binding_modality="",
            time=None,
            generation=None,
            binding_constraint="none: layout given, not searched",
            explanation=("layout given by the caller; no prediction was made",),
        )

    @property
    def tp(self) -> int:
        """Tensor-parallel degree."""
        return self.config.tp

    @property
    def pp(self) -> int:
        """Pipeline-parallel degree."""
        return self.config.pp

    @property
    def cp(self) -> int:
        """Context-parallel degree."""
        return self.config.cp

    @property
    def ep(self) -> int:
        """Expert-parallel degree."""
        return self.config.ep

    @property
    def dp(self) -> int:
        """Data-parallel degree (rollout: engine replicas)."""
        return self.config.dp

    @property
    def world_size(self) -> int:
        """GPUs the service occupies."""
        return self.config.world_size

    @property
    def step_time_s(self) -> float:
        """Predicted seconds per step (rollout: with continuous batching)."""
        if self.generation is not None:
            return self.generation.async_s
        return self.time.total if self.time is not None else 0.0

    # ------------------------------------------------------------------ realisation

    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of the device mesh dimensions ``MESH_DIMS``."""
        c = self.config
        return (c.pp, c.dp, c.cp, c.tp)

    def rank_groups(self) -> dict[str, list[list[int]]]:
        """Global ranks of every group per mesh dimension, in the same layout as device_mesh().

        Returns:
            For each of ``MESH_DIMS`` (and ``ep``/``edp`` for expert layers), the list of rank groups.
        """
        out = _groups(self.mesh_shape(), MESH_DIMS)
        out.update({k: v for k, v in _groups(self.expert_mesh_shape(), EXPERT_MESH_DIMS).items() if k != "pp"})
        return out

    def expert_mesh_shape(self) -> tuple[int, ...]:
        """Sizes of the expert mesh dimensions ``EXPERT_MESH_DIMS``."""
        c = self.config
        return (c.pp, c.expert_dp, c.ep, c.tp)

    def device_mesh(self, device_type: str = "cuda") -> DeviceMesh:
        """Build the torch DeviceMesh with named dimensions ``("pp", "dp", "cp", "tp")``.

        The default process group must already be initialised with ``world_size`` ranks. Rank r sits at
        tp = r mod tp, cp = (r // tp) mod cp, dp = (r // (tp·cp)) mod dp, pp = r // (tp·cp·dp), the same
        placement megatron-core uses with ``order="tp-cp-ep-dp-pp"``, so TP groups are node-local.

        Args:
            device_type: ``"cuda"`` for NCCL, ``"cpu"`` for gloo.

        Returns:
            The mesh; ``mesh.get_group("tp")`` etc. give the process groups.
        """
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.mesh_shape(), mesh_dim_names=MESH_DIMS)

    def expert_device_mesh(self, device_type: str = "cuda") -> DeviceMesh:
        """Build the expert-layer mesh ``("pp", "edp", "ep", "tp")``: ep splits the cp·dp ranks of a stage.

        Matches megatron-core's expert groups with ``expert_tensor_parallel_size = tp``.
        """
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.expert_mesh_shape(), mesh_dim_names=EXPERT_MESH_DIMS)

    def megatron_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``megatron.core.parallel_state.initialize_model_parallel``.

        Uses only arguments present in megatron-core 0.12 through 0.16.
        """
        c = self.config
        return {
            "tensor_model_parallel_size": c.tp,
            "pipeline_model_parallel_size": c.pp,
            "context_parallel_size": c.cp,
            "expert_model_parallel_size": c.ep,
            "expert_tensor_parallel_size": c.tp,
            "order": MEGATRON_ORDER,
        }

    # ------------------------------------------------------------------ presentation

    def table(self) -> str:
        """A human-readable plan: degrees, predictions, per-modality treatment and reasons."""
        c = self.config
        if self.generation is not None:
            layout = f"{c.dp} inference engine(s) of tp={c.tp}"
        else:
            layout = (
                f"tp={c.tp} pp={c.pp} cp={c.cp} ep={c.ep} dp={c.dp} micro-batch={c.micro_batch} recompute={c.recompute}"
            )
        lines = [
            f"[{self.service}] {self.world_size} GPUs: {layout}",
            f"  memory/GPU   {self.memory.describe()} of {self.memory_limit / GIB:.1f} GiB usable "
            f"(binding modality: {self.binding_modality})",
        ]
        if self.time is not None:
            lines.append(f"  step time    {self.time.describe()}")
        if self.generation is not None:
            g = self.generation
            lines.append(
                f"  step time    {g.async_s:.2f} s with continuous batching, {g.sync_s:.2f} s synchronous "
                f"(concurrency {g.concurrency}/engine, decode step {g.decode_step_s * 1e3:.1f} ms)"
            )
        lines.append(f"  binding      {self.binding_constraint}")
        for name, where in self.encoder_placement.items():
            lines.append(f"  {name + ' enc':<12} {where}")
        if self.modalities:
            lines.append("  modality  max tokens  mb  approach")
            for s in self.modalities:
                lines.append(f"  {s.modality:<8} {s.sequence_tokens:>11,}  {s.micro_batch:>2}  {s.approach}")
                lines.append(f"  {'':<8} {'':>11}  {'':>2}  ↳ {s.reason}")
        lines.extend(f"  - {line}" for line in self.explanation)
        return "\n".join(lines)


def _groups(shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, list[list[int]]]:
    """Rank groups per dimension of a row-major mesh of ranks 0..prod(shape)-1."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    out: dict[str, list[list[int]]] = {}
    for d, name in enumerate(names):
        others = [range(n) if i != d else range(1) for i, n in enumerate(shape)]
        groups = []
        for idx in itertools.product(*others):
            base = sum(i * s for i, s in zip(idx, strides, strict=True))
            groups.append([base + k * strides[d] for k in range(shape[d])])
        out[name] = groups
    return out
