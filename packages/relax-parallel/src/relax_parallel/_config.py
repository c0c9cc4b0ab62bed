"""A candidate parallel layout: the degrees the search enumerates."""

from __future__ import annotations

import math
from dataclasses import dataclass

RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel degrees and training switches for one service.

    World size is tp · cp · dp · pp; expert parallelism (ep) subdivides the dp · cp ranks of each
    pipeline stage, as in megatron-core where expert layers see tokens from every dp and cp rank.

    Attributes:
        tp: Tensor-parallel degree (with sequence parallelism whenever tp > 1).
        pp: Pipeline stages.
        cp: Context-parallel degree (sequence split over ranks, ring attention).
        ep: Expert-parallel degree (MoE only).
        dp: Data-parallel degree.
        micro_batch: Sequences per micro-batch.
        recompute: Activation recomputation: none, selective (attention core) or full (every layer).
        distributed_optimizer: Shard optimizer states over the dp · cp group (ZeRO-1).
        vision_tp: Shard the vision encoder over the TP group (otherwise replicated on each TP rank).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    distributed_optimizer: bool = True
    vision_tp: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "dp", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute: {self.recompute!r} not in {RECOMPUTE_MODES}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep: {self.ep} must divide dp·cp = {self.dp * self.cp}")

    @property
    def world_size(self) -> int:
        """GPUs the layout occupies."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def sequence_parallel(self) -> bool:
        """Megatron sequence parallelism rides on TP: layer norms and dropout are split over the TP group."""
        return self.tp > 1

    @property
    def expert_dp(self) -> int:
        """Data-parallel degree of the expert weights: dp · cp / ep."""
        return self.dp * self.cp // self.ep

    def micro_batches(self, samples_per_step: int) -> int:
        """Micro-batches each pipeline processes per optimizer step (m)."""
        return max(1, math.ceil(samples_per_step / (self.dp * self.micro_batch)))

    def short(self) -> str:
        """Compact one-line form, e.g. ``tp=4 pp=1 cp=2 ep=1 dp=2 mb=1 recompute=full``."""
        return (
            f"tp={self.tp} pp={self.pp} cp={self.cp} ep={self.ep} dp={self.dp} "
            f"mb={self.micro_batch} recompute={self.recompute}"
        )
