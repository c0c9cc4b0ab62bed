"""Input specifications: the model, the workload and the cluster the planner plans for."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

MODALITIES: tuple[str, ...] = ("text", "image", "video", "audio")


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class VisionEncoderSpec:
    """A ViT-style vision encoder (Qwen2.5-VL / Qwen-Omni family).

    Attributes:
        depth: Number of transformer blocks.
        hidden_size: Width of each block.
        ffn_hidden_size: MLP inner width.
        num_heads: Attention heads.
        patch_size: Spatial patch edge in pixels.
        spatial_merge_size: Patches merged per side before the LLM (2 → 4 patches per LLM token).
        temporal_patch_size: Video frames grouped into one temporal patch.
        out_hidden_size: Width of the merger output (the LLM hidden size).
        gated_mlp: SwiGLU-style MLP (three matrices) rather than two.
    """

    depth: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 0
    gated_mlp: bool = True

    def num_params(self) -> int:
        """Parameter count: patch embedding, blocks (attention, MLP, norms) and the patch merger."""
        h, f = self.hidden_size, self.ffn_hidden_size
        patch_embed = 3 * self.temporal_patch_size * self.patch_size**2 * h
        attn = 4 * h * h + 4 * h  # qkv + proj with biases
        mlp = (3 if self.gated_mlp else 2) * h * f
        block = attn + mlp + 2 * h
        merged = h * self.spatial_merge_size**2
        merger = merged * merged + merged * (self.out_hidden_size or h)
        return patch_embed + self.depth * block + merger

    def patches(self, height: int, width: int, frames: int = 1) -> int:
        """Encoder patches for one image (frames=1) or video, after rounding to whole merge blocks."""
        block = self.patch_size * self.spatial_merge_size
        grid_h = max(1, round(height / block)) * self.spatial_merge_size
        grid_w = max(1, round(width / block)) * self.spatial_merge_size
        grid_t = max(1, math.ceil(frames / self.temporal_patch_size)) if frames > 1 else 1
        return grid_t * grid_h * grid_w

    def llm_tokens(self, height: int, width: int, frames: int = 1) -> int:
        """LLM tokens the encoder emits for one image or video (patches / merge²)."""
        return self.patches(height, width, frames) // self.spatial_merge_size**2


@dataclass(frozen=True)
class AudioEncoderSpec:
    """A Whisper-style audio encoder run over fixed windows of mel frames (chunked).

    Attributes:
        num_layers: Transformer layers.
        hidden_size: Width (d_model).
        ffn_hidden_size: MLP inner width.
        num_heads: Attention heads.
        num_mel_bins: Mel channels of the input features.
        encoder_frames_per_second: Sequence positions per second inside the encoder.
        tokens_per_second: LLM tokens per second of audio after pooling.
        chunk_seconds: Window the encoder attends within; chunks are independent.
        out_hidden_size: Width of the projection into the LLM.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_mel_bins: int = 128
    encoder_frames_per_second: float = 50.0
    tokens_per_second: float = 25.0
    chunk_seconds: float = 2.0
    out_hidden_size: int = 0

    def num_params(self) -> int:
        """Parameter count: two-conv stem, blocks and output projection."""
        d, f = self.hidden_size, self.ffn_hidden_size
        stem = 3 * self.num_mel_bins * d + 3 * d * d
        block = 4 * d * d + 2 * d * f + 4 * d
        return stem + self.num_layers * block + d * (self.out_hidden_size or d)

    def encoder_frames(self, seconds: float) -> int:
        """Encoder sequence positions for a clip."""
        return math.ceil(seconds * self.encoder_frames_per_second)

    def llm_tokens(self, seconds: float) -> int:
        """LLM tokens for a clip."""
        return math.ceil(seconds * self.tokens_per_second)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder LLM with optional per-modality encoders.

    Attributes:
        name: Display name.
        num_layers: Decoder layers.
        hidden_size: Model width h.
        num_heads: Query heads a.
        num_kv_heads: Key/value heads (grouped-query attention).
        ffn_hidden_size: Dense MLP inner width.
        vocab_size: Vocabulary V.
        head_dim: Per-head width; defaults to hidden_size / num_heads.
        gated_mlp: SwiGLU MLP with gate, up and down matrices.
        qkv_bias: Biases on the Q, K, V projections (Qwen2).
        tied_embeddings: Input embedding shared with the LM head.
        num_experts: Routed experts per MoE layer; 0 for a dense model.
        experts_top_k: Experts each token is routed to.
        moe_ffn_hidden_size: Inner width of one expert.
        vision: Vision encoder, if any.
        audio: Audio encoder, if any.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    head_dim: int = 0
    gated_mlp: bool = True
    qkv_bias: bool = True
    tied_embeddings: bool = False
    num_experts: int = 0
    experts_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    vision: VisionEncoderSpec | None = None
    audio: AudioEncoderSpec | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size"):
            _require(getattr(self, name) > 0, name, "must be positive")
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", "must divide num_heads")
        if self.head_dim == 0:
            _require(self.hidden_size % self.num_heads == 0, "head_dim", "hidden_size not divisible by num_heads")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_experts:
            _require(0 < self.experts_top_k <= self.num_experts, "experts_top_k", "must be in 1..num_experts")
            _require(self.moe_ffn_hidden_size > 0, "moe_ffn_hidden_size", "must be positive for an MoE model")

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_experts > 0

    def attention_params(self) -> int:
        """Per-layer attention parameters (Q, K, V, O and the Q/K/V biases)."""
        h, d, a, kv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        bias = (a + 2 * kv) * d if self.qkv_bias else 0
        return h * (a + 2 * kv) * d + a * d * h + bias

    def dense_mlp_params(self) -> int:
        """Per-layer dense MLP parameters (0 for an MoE model)."""
        if self.is_moe:
            return 0
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_hidden_size

    def expert_params(self) -> int:
        """Per-layer routed-expert parameters (all experts)."""
        if not self.is_moe:
            return 0
        return self.num_experts * (3 if self.gated_mlp else 2) * self.hidden_size * self.moe_ffn_hidden_size

    def layer_nonexpert_params(self) -> int:
        """Per-layer parameters outside the experts: attention, dense MLP, router, two norms."""
        router = self.hidden_size * self.num_experts
        return self.attention_params() + self.dense_mlp_params() + router + 2 * self.hidden_size

    def embedding_params(self) -> int:
        """Input embedding plus LM head (once if tied) plus the final norm."""
        vh = self.vocab_size * self.hidden_size
        return vh * (1 if self.tied_embeddings else 2) + self.hidden_size

    def llm_params(self) -> int:
        """All decoder parameters."""
        per_layer = self.layer_nonexpert_params() + self.expert_params()
        return self.num_layers * per_layer + self.embedding_params()

    def active_llm_params(self) -> int:
        """Decoder parameters one token passes through (top-k experts only), without embeddings."""
        active_experts = self.expert_params() * self.experts_top_k // max(self.num_experts, 1)
        return self.num_layers * (self.layer_nonexpert_params() + active_experts)

    def encoder_params(self) -> int:
        """Vision plus audio encoder parameters."""
        return (self.vision.num_params() if self.vision else 0) + (self.audio.num_params() if self.audio else 0)

    def total_params(self) -> int:
        """Decoder plus encoders."""
        return self.llm_params() + self.encoder_params()


@dataclass(frozen=True)
class WorkloadSpec:
    """What one RL step processes.

    Attributes:
        modality_mix: Fraction of samples per modality (keys among text, image, video, audio; sums to 1).
            Every sample has text; an image/video/audio sample adds that modality's tokens.
        prompt_tokens: Mean text prompt tokens.
        response_tokens: Mean generated tokens.
        max_response_tokens: Generation cap; the long tail sizes memory and synchronous rollout.
        image_size: Image (height, width) in pixels after resizing.
        images_per_sample: Images in an image sample.
        video_frames: Sampled frames per video.
        video_size: Video frame (height, width) in pixels.
        audio_seconds: Audio clip length.
        prompts_per_step: Prompts per optimizer step.
        group_size: Samples per prompt (GRPO group); samples per step = prompts × group.
        train_encoders: Whether encoders are updated (False: frozen, forward only).
    """

    modality_mix: Mapping[str, float] = field(default_factory=lambda: {"text": 1.0})
    prompt_tokens: int = 512
    response_tokens: int = 1024
    max_response_tokens: int = 4096
    image_size: tuple[int, int] = (448, 448)
    images_per_sample: int = 1
    video_frames: int = 128
    video_size: tuple[int, int] = (448, 448)
    audio_seconds: float = 30.0
    prompts_per_step: int = 32
    group_size: int = 8
    train_encoders: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.modality_mix) - set(MODALITIES)
        _require(not unknown, "modality_mix", f"unknown modalities {sorted(unknown)}; allowed {list(MODALITIES)}")
        _require(all(v >= 0 for v in self.modality_mix.values()), "modality_mix", "fractions must be >= 0")
        total = sum(self.modality_mix.values())
        _require(abs(total - 1.0) < 1e-6, "modality_mix", f"fractions must sum to 1, got {total:.4f}")
        _require(self.prompt_tokens > 0 and self.response_tokens > 0, "prompt_tokens", "token counts must be > 0")
        _require(self.max_response_tokens >= self.response_tokens, "max_response_tokens", "must be >= mean")
        _require(self.prompts_per_step > 0 and self.group_size > 0, "prompts_per_step", "must be positive")

    @property
    def samples_per_step(self) -> int:
        """Samples consumed by one optimizer step."""
        return self.prompts_per_step * self.group_size

    def active_modalities(self) -> list[str]:
        """Modalities with a non-zero share, in canonical order."""
        return [m for m in MODALITIES if self.modality_mix.get(m, 0.0) > 0]

    def modality_tokens(self, model: ModelSpec, modality: str) -> int:
        """LLM tokens a sample's non-text input adds (0 for text or a model without that encoder)."""
        if modality == "image" and model.vision:
            return self.images_per_sample * model.vision.llm_tokens(*self.image_size)
        if modality == "video" and model.vision:
            return model.vision.llm_tokens(*self.video_size, frames=self.video_frames)
        if modality == "audio" and model.audio:
            return model.audio.llm_tokens(self.audio_seconds)
        _require(modality in MODALITIES, "modality", f"unknown {modality!r}")
        if modality != "text":
            raise ValueError(f"modality_mix: model {model.name} has no encoder for {modality!r}")
        return 0

    def sequence_tokens(self, model: ModelSpec, modality: str) -> tuple[int, int]:
        """(mean, max) sequence length in LLM tokens for a sample of one modality."""
        base = self.prompt_tokens + self.modality_tokens(model, modality)
        return base + self.response_tokens, base + self.max_response_tokens


@dataclass(frozen=True)
class ClusterSpec:
    """The GPUs available and how fast they compute and talk.

    Attributes:
        num_gpus: Total GPUs.
        gpus_per_node: GPUs sharing the fast intra-node link (NVLink).
        gpu_memory_gib: Memory per GPU.
        usable_fraction: Share of memory a plan may fill (the rest: CUDA context, allocator fragmentation).
        peak_tflops: Dense bf16 peak per GPU.
        mfu: Achievable fraction of peak for large matmuls.
        hbm_gbps: Memory bandwidth per GPU, GB/s (decode is bound by it).
        intra_node_gbps: Per-GPU bus bandwidth inside a node, GB/s.
        inter_node_gbps: Per-GPU bandwidth across nodes, GB/s.
        collective_latency_us: Latency α of one ring step (α-β model; intra-node NCCL is ~5-10 µs).
    """

    num_gpus: int
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    usable_fraction: float = 0.9
    peak_tflops: float = 989.0
    mfu: float = 0.4
    hbm_gbps: float = 3350.0
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 50.0
    collective_latency_us: float = 10.0

    def __post_init__(self) -> None:
        _require(self.num_gpus > 0, "num_gpus", "must be positive")
        _require(self.gpus_per_node > 0, "gpus_per_node", "must be positive")
        _require(
            self.num_gpus <= self.gpus_per_node or self.num_gpus % self.gpus_per_node == 0,
            "num_gpus",
            f"must fit within one node or be a multiple of gpus_per_node={self.gpus_per_node}",
        )
        _require(0 < self.usable_fraction <= 1, "usable_fraction", "must be in (0, 1]")
        _require(0 < self.mfu <= 1, "mfu", "must be in (0, 1]")

    @property
    def usable_bytes(self) -> float:
        """Bytes per GPU a plan may use."""
        return self.gpu_memory_gib * 2**30 * self.usable_fraction

    @property
    def flops_per_s(self) -> float:
        """Sustained FLOP/s per GPU (peak × MFU)."""
        return self.peak_tflops * 1e12 * self.mfu

    @property
    def latency_s(self) -> float:
        """Latency of one ring step, seconds."""
        return self.collective_latency_us * 1e-6

    def link_gbps(self, span: int) -> float:
        """Bandwidth of a group whose ranks lie within `span` consecutive global ranks."""
        return self.intra_node_gbps if span <= self.gpus_per_node else self.inter_node_gbps
