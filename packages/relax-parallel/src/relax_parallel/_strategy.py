"""Per-modality strategy: how each modality's data and encoder ride on a chosen layout."""

from __future__ import annotations

from dataclasses import dataclass, replace

from relax_parallel._config import ParallelConfig
from relax_parallel._memory import BF16, GIB, OPTIMIZER_BYTES, training_memory
from relax_parallel._specs import ClusterSpec, ModelSpec, WorkloadSpec

# An encoder is sharded over TP once its model states would take more than this share of usable memory;
# below it, replication avoids two all-reduces per encoder block on small matmuls.
ENCODER_SHARD_FRACTION = 0.10
# Sequences at least this long are "long" for text: context parallelism pays for its ring exchange there.
LONG_SEQUENCE_TOKENS = 32_768
MICRO_BATCH_CHOICES: tuple[int, ...] = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class ModalityStrategy:
    """How one modality is processed under a plan.

    Attributes:
        modality: text, image, video or audio.
        approach: Short description of the parallel treatment.
        micro_batch: Sequences of this modality packed per micro-batch (largest that fits).
        sequence_tokens: Longest sequence of this modality, LLM tokens.
        reason: Why this treatment.
    """

    modality: str
    approach: str
    micro_batch: int
    sequence_tokens: int
    reason: str


def shard_vision_encoder(model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec, tp: int) -> bool:
    """Whether the vision encoder should be tensor-parallel (by size) rather than replicated."""
    if not model.vision or tp == 1:
        return False
    per_param = BF16 + (BF16 + OPTIMIZER_BYTES if workload.train_encoders else 0)
    return model.vision.num_params() * per_param > ENCODER_SHARD_FRACTION * cluster.usable_bytes


def encoder_placement(
    model: ModelSpec, workload: WorkloadSpec, cfg: ParallelConfig, *, inference: bool = False
) -> dict[str, str]:
    """Where each encoder lives under the layout (``inference``: inside each rollout engine)."""
    trained = "forward only" if inference else ("trained" if workload.train_encoders else "frozen, forward only")
    where = "every engine" if inference else "pipeline stage 0"
    out: dict[str, str] = {}
    if model.vision:
        how = f"tensor-parallel over tp={cfg.tp}" if cfg.vision_tp else "replicated on every rank"
        out["vision"] = f"{where}, {how} ({trained})"
    if model.audio:
        chunks = f"{model.audio.chunk_seconds:g} s chunks encoded independently"
        out["audio"] = f"{where}, replicated, {chunks} ({trained})"
    return out


def _largest_micro_batch(
    model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec, cfg: ParallelConfig, modality: str
) -> int:
    best = 0
    for b in MICRO_BATCH_CHOICES:
        if training_memory(model, workload, replace(cfg, micro_batch=b), modality).total <= cluster.usable_bytes:
            best = b
    return max(best, 1)


def modality_strategies(
    model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec, cfg: ParallelConfig
) -> tuple[ModalityStrategy, ...]:
    """Describe each active modality's treatment under the chosen layout."""
    out: list[ModalityStrategy] = []
    vision_params = model.vision.num_params() if model.vision else 0
    chunk_s = model.audio.chunk_seconds if model.audio else 0.0
    for modality in workload.active_modalities():
        seq = workload.sequence_tokens(model, modality)[1]
        b = _largest_micro_batch(model, workload, cluster, cfg, modality)
        sp = f"sequence parallel within tp={cfg.tp}" if cfg.tp > 1 else "no tensor parallelism"
        if modality == "text":
            if cfg.cp > 1 and seq >= LONG_SEQUENCE_TOKENS:
                approach = f"context parallel cp={cfg.cp} + {sp}"
                reason = f"{seq:,}-token sequences are long; ring attention splits them {seq // cfg.cp:,} per rank"
            else:
                approach = f"{sp}, {b} sequence{'s' if b > 1 else ''} packed per micro-batch"
                reason = f"{seq:,}-token sequences are short; packing keeps GPUs busy without splitting sequences"
        elif modality == "image":
            approach = "vision encoder " + ("tensor-parallel" if cfg.vision_tp else "replicated") + f", {sp}"
            reason = f"{vision_params / 1e6:.0f} M-parameter encoder " + (
                "is large enough to shard" if cfg.vision_tp else "is small; replication avoids its all-reduces"
            )
        elif modality == "video":
            pipe = f"pipeline pp={cfg.pp}" if cfg.pp > 1 else "no pipeline (layers fit on one stage)"
            if cfg.cp > 1:
                approach = f"context parallel cp={cfg.cp} over temporal tokens + {pipe}"
                reason = (
                    f"{seq:,}-token video sequences: each rank takes {seq // cfg.cp:,} tokens of consecutive "
                    "temporal patches, and the vision encoder attends within a temporal patch, so it splits exactly"
                )
            else:
                approach = f"whole sequences per rank + {pipe}"
                reason = f"{seq:,}-token video sequences fit one rank's memory; cp=1 avoids the ring exchange"
        else:
            approach = "chunked encoder, data parallel over chunks"
            reason = (
                f"{workload.audio_seconds:g} s clips encode in independent "
                f"{chunk_s:g} s windows, so memory stays linear in clip length"
            )
        out.append(ModalityStrategy(modality, approach, b, seq, reason))
    return tuple(out)


def gib(nbytes: float) -> str:
    """Format bytes as GiB with one decimal."""
    return f"{nbytes / GIB:.1f} GiB"
