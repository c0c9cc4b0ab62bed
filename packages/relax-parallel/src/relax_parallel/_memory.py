"""Per-GPU memory model: model states, activations, logits and KV cache.

Byte counts assume bf16 weights and activations. Every formula names its source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from relax_parallel._config import ParallelConfig
from relax_parallel._specs import ModelSpec, WorkloadSpec

GIB = 2**30
BF16 = 2
# Mixed-precision Adam (Rajbhandari et al. 2020, ZeRO, §3.1): 2 bytes bf16 weights + 2 bytes bf16 gradients
# + K = 12 bytes of fp32 master weights, momentum and variance per parameter -> 16 bytes per parameter.
OPTIMIZER_BYTES = 12


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted bytes per GPU on the most loaded pipeline stage.

    Attributes:
        weights: bf16 parameters (trainable and frozen, including encoders on this stage).
        gradients: bf16 gradients of trainable parameters.
        optimizer: fp32 master weights and Adam moments (sharded by the distributed optimizer).
        activations: Saved activations of decoder layers and encoders, including micro-batches in flight.
        logits: fp32 logits for log-probabilities on the last stage.
        kv_cache: Rollout KV cache.
    """

    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    kv_cache: float = 0.0

    @property
    def total(self) -> float:
        """Sum of all terms, bytes."""
        return float(sum(getattr(self, f.name) for f in fields(self)))

    @property
    def model_states(self) -> float:
        """Weights + gradients + optimizer states, bytes."""
        return self.weights + self.gradients + self.optimizer

    def largest(self) -> tuple[str, float]:
        """The largest term and its bytes."""
        return max(((f.name, getattr(self, f.name)) for f in fields(self)), key=lambda kv: kv[1])

    def describe(self) -> str:
        """Human-readable non-zero terms in GiB."""
        parts = [f"{f.name} {getattr(self, f.name) / GIB:.1f}" for f in fields(self) if getattr(self, f.name) > 0]
        return f"{self.total / GIB:.1f} GiB (" + ", ".join(parts) + ")"


def layer_activation_coefficient(model: ModelSpec, seq_len: int, *, flash_attention: bool = True) -> float:
    """Bytes per token per unit hidden size that one decoder layer saves for backward.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1): a GPT
    layer stores s·b·h·(34 + 5·a·s/h) bytes: attention 11·sbh + 5·a·s²·b, MLP 19·sbh, two layer norms 4·sbh.
    Generalised here: grouped-query K and V shrink their 4·sbh to 4·sbh·kv/a; a gated MLP of width f stores
    its input (2), dropout mask (1) and gate/up/activation outputs (3 × 2·f/h) instead of 19; an MoE MLP does
    so for each of its top-k experts. FlashAttention (Dao et al. 2022) never materialises the 5·a·s/h
    softmax term, which is also what selective recomputation removes.
    """
    h, a, kv = model.hidden_size, model.num_heads, model.num_kv_heads
    attention = 7 + 4 * kv / a
    width, experts = (model.moe_ffn_hidden_size, model.experts_top_k) if model.is_moe else (model.ffn_hidden_size, 1)
    mlp = 3 + (6 if model.gated_mlp else 4) * experts * width / h
    coefficient = attention + mlp + 4
    if not flash_attention:
        coefficient += 5 * a * seq_len / h
    return coefficient


def layer_activation_bytes(
    model: ModelSpec, seq_len: int, micro_batch: int, cfg: ParallelConfig, *, flash_attention: bool = True
) -> float:
    """Bytes one decoder layer keeps for backward for one micro-batch on one GPU.

    Korthikanti et al. 2022: with tensor and sequence parallelism every term divides by t (§4.2.2); selective
    recomputation keeps 34·sbh/t (§5); full recomputation keeps only the layer input, 2·sbh/t (§5).
    Context parallelism divides s by cp (each rank holds s/cp tokens).
    """
    tokens = seq_len * micro_batch / cfg.cp
    if cfg.recompute == "full":
        return 2 * tokens * model.hidden_size / cfg.tp
    flash = flash_attention or cfg.recompute == "selective"
    coefficient = layer_activation_coefficient(model, seq_len // cfg.cp, flash_attention=flash)
    return coefficient * tokens * model.hidden_size / cfg.tp


def _encoder_activation_bytes(model: ModelSpec, workload: WorkloadSpec, cfg: ParallelConfig, modality: str) -> float:
    """Encoder activations on pipeline stage 0 for one micro-batch of the given modality.

    A frozen encoder runs without autograd, so only one block's working set is live; a trained encoder saves
    every block (Korthikanti's per-layer count with the encoder's own width, MLP coefficient 3 + 6f/h gated or
    19 ungated). Video patches are split over cp along time; audio is chunked, so attention stays within a
    chunk and memory is linear in the clip length.
    """
    if modality in ("image", "video") and model.vision:
        enc = model.vision
        h, f, depth = enc.hidden_size, enc.ffn_hidden_size, enc.depth
        if modality == "image":
            positions = workload.images_per_sample * enc.patches(*workload.image_size)
        else:
            positions = math.ceil(enc.patches(*workload.video_size, frames=workload.video_frames) / cfg.cp)
        split = cfg.tp if cfg.vision_tp else 1
        mlp = 3 + (6 if enc.gated_mlp else 4) * f / h
    elif modality == "audio" and model.audio:
        enc_a = model.audio
        h, depth, split = enc_a.hidden_size, enc_a.num_layers, 1
        positions = enc_a.encoder_frames(workload.audio_seconds)
        mlp = 3 + 4 * enc_a.ffn_hidden_size / h
    else:
        return 0.0
    per_layer = (11 + mlp + 4) * positions * cfg.micro_batch * h / split
    if not workload.train_encoders:
        return per_layer
    if cfg.recompute == "full":
        return 2 * positions * cfg.micro_batch * h / split * depth + per_layer
    return per_layer * depth


def _stage_params(model: ModelSpec, cfg: ParallelConfig, *, first: bool, last: bool) -> tuple[float, float, float]:
    """(non-expert, expert, encoder) parameters held by one GPU of a pipeline stage."""
    layers = model.num_layers / cfg.pp
    dense = layers * model.layer_nonexpert_params() / cfg.tp
    # Expert weights: split over ep, each expert tensor-parallel over etp = tp (megatron-core's default).
    experts = layers * model.expert_params() / (cfg.ep * cfg.tp)
    vocab = model.vocab_size * model.hidden_size / cfg.tp
    if first:
        dense += vocab
    if last and (not first or not model.tied_embeddings):
        dense += vocab
    if last:
        dense += model.hidden_size  # final norm
    encoders = 0.0
    if first:
        if model.vision:
            encoders += model.vision.num_params() / (cfg.tp if cfg.vision_tp else 1)
        if model.audio:
            encoders += model.audio.num_params()
    return dense, experts, encoders


def training_memory(
    model: ModelSpec, workload: WorkloadSpec, cfg: ParallelConfig, modality: str, *, forward_only: bool = False
) -> MemoryBreakdown:
    """Per-GPU memory to train (or, with forward_only, to score) on the longest sequence of one modality.

    Returns the larger of pipeline stage 0 (embedding, encoders, the most micro-batches in flight) and the
    last stage (LM head, logits).
    """
    seq_len = workload.sequence_tokens(model, modality)[1]
    m = cfg.micro_batches(workload.samples_per_step)
    layer_bytes = layer_activation_bytes(model, seq_len, cfg.micro_batch, cfg)
    # Full recomputation rebuilds one layer's complete activations during its backward pass; a forward-only
    # pass keeps one layer's working set.
    whole_layer = layer_activation_bytes(model, seq_len, cfg.micro_batch, replace(cfg, recompute="none"))
    working = whole_layer if cfg.recompute == "full" or forward_only else 0.0
    # 1F1B (Narayanan et al. 2021, §2.2.1): stage i holds up to p − i micro-batches in flight, so stage 0
    # stores min(p, m) micro-batches of its L/p layers (Korthikanti et al. 2022, §4.2.3).
    stored = 0.0 if forward_only else (model.num_layers / cfg.pp) * min(cfg.pp, m) * layer_bytes
    best = MemoryBreakdown()
    for first, last in {(True, cfg.pp == 1), (cfg.pp == 1, True)}:
        dense, experts, encoders = _stage_params(model, cfg, first=first, last=last)
        trainable = dense + experts + (encoders if workload.train_encoders else 0.0)
        if forward_only:
            grads = optim = 0.0
        else:
            grads = BF16 * trainable
            shard, expert_shard = (cfg.dp * cfg.cp, cfg.expert_dp) if cfg.distributed_optimizer else (1, 1)
            optim = OPTIMIZER_BYTES * ((trainable - experts) / shard + experts / expert_shard)
        acts = stored + working
        if first:
            acts += _encoder_activation_bytes(model, workload, cfg, modality)
        # fp32 logits of the vocabulary-parallel output layer, s/cp tokens (Korthikanti et al. 2022, §4.3).
        logits = 4 * seq_len / cfg.cp * cfg.micro_batch * model.vocab_size / cfg.tp if last else 0.0
        cand = MemoryBreakdown(BF16 * (dense + experts + encoders), grads, optim, acts, logits)
        if cand.total > best.total:
            best = cand
    return best


def kv_cache_bytes_per_token(model: ModelSpec, tp: int) -> float:
    """KV cache bytes per token per GPU: 2 (K and V) · layers · kv_heads/tp · head_dim · 2 bytes.

    Kwon et al. 2023 (vLLM / PagedAttention). When tp exceeds the KV heads each rank keeps a replica of one
    head, so the per-rank count is ceil(kv/tp).
    """
    kv_per_rank = math.ceil(model.num_kv_heads / tp)
    return 2 * model.num_layers * kv_per_rank * model.head_dim * BF16


def inference_weight_bytes(model: ModelSpec, tp: int) -> float:
    """bf16 weights per GPU of a TP-sharded inference engine (encoders replicated)."""
    return BF16 * (model.llm_params() / tp + model.encoder_params())
