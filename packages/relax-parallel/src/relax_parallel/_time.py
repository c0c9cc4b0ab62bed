"""Time model: FLOPs, communication and pipeline bubble for training, scoring and generation."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from relax_parallel._config import ParallelConfig
from relax_parallel._memory import BF16, inference_weight_bytes, kv_cache_bytes_per_token
from relax_parallel._specs import ClusterSpec, ModelSpec, WorkloadSpec


@dataclass(frozen=True)
class TimeBreakdown:
    """Predicted seconds per optimizer step on one GPU.

    Attributes:
        compute: FLOPs at sustained throughput (peak × MFU).
        bubble: 1F1B pipeline bubble.
        tp_comm: Tensor-parallel all-reduces (or all-gather/reduce-scatter under sequence parallelism).
        pp_comm: Point-to-point activation and gradient sends between stages.
        dp_comm: Data-parallel gradient reduction.
        cp_comm: Context-parallel ring exchange not hidden behind attention compute.
        ep_comm: Expert all-to-all dispatch and combine.
    """

    compute: float = 0.0
    bubble: float = 0.0
    tp_comm: float = 0.0
    pp_comm: float = 0.0
    dp_comm: float = 0.0
    cp_comm: float = 0.0
    ep_comm: float = 0.0

    @property
    def total(self) -> float:
        """Step time, seconds."""
        return float(sum(getattr(self, f.name) for f in fields(self)))

    def describe(self) -> str:
        """Non-zero terms in seconds."""
        parts = [f"{f.name} {getattr(self, f.name):.2f}" for f in fields(self) if getattr(self, f.name) > 5e-4]
        return f"{self.total:.2f} s (" + ", ".join(parts) + ")"


def ring_allreduce_seconds(nbytes: float, n: int, gbps: float, latency_s: float = 0.0) -> float:
    """Ring all-reduce in the α-β model: 2(n−1) steps, each rank moving 2(n−1)/n of the buffer.

    Patarasuk & Yuan 2009 (bandwidth-optimal ring); Thakur et al. 2005 (α-β cost 2(n−1)α + 2(n−1)/n·nβ).
    """
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes / (gbps * 1e9)


def pipeline_bubble_fraction(pp: int, micro_batches: int) -> float:
    """1F1B bubble relative to ideal compute: (p − 1) / m (Narayanan et al. 2021, §2.2.1)."""
    return (pp - 1) / micro_batches


def decoder_forward_flops_per_token(model: ModelSpec, context: float) -> float:
    """Forward FLOPs for one token attending over `context` tokens.

    Narayanan et al. 2021 (§5.1, FLOP count): a layer costs 24·B·s·h² + 4·B·s²·h forward, i.e. 2 FLOPs per
    parameter per token plus 4·s·h for QKᵀ and attention·V; the LM head adds 2·h·V per token. Here the
    parameter term uses the layer's actual (GQA, gated-MLP, top-k-expert) parameter count and the attention
    term uses a·d for h; like the paper, causal masking is not discounted.
    """
    params = 2 * model.active_llm_params()
    attention = 4 * context * model.num_heads * model.head_dim * model.num_layers
    head = 2 * model.hidden_size * model.vocab_size
    return params + attention + head


def _encoder_forward_flops(model: ModelSpec, workload: WorkloadSpec, modality: str) -> float:
    """Forward FLOPs of a sample's encoder: 2·params per position plus attention within its window.

    The Qwen vision encoder attends within each temporal patch group, so the attention context is one
    slice's patches; the audio encoder attends within fixed chunks (chunk_seconds).
    """
    if modality in ("image", "video") and model.vision:
        enc = model.vision
        if modality == "image":
            per_item = enc.patches(*workload.image_size)
            positions, context = workload.images_per_sample * per_item, per_item
        else:
            positions = enc.patches(*workload.video_size, frames=workload.video_frames)
            context = enc.patches(*workload.video_size)
        return positions * (2 * enc.num_params() + 4 * context * enc.hidden_size * enc.depth)
    if modality == "audio" and model.audio:
        enc_a = model.audio
        positions = enc_a.encoder_frames(workload.audio_seconds)
        context = min(positions, enc_a.encoder_frames(enc_a.chunk_seconds))
        return positions * (2 * enc_a.num_params() + 4 * context * enc_a.hidden_size * enc_a.num_layers)
    return 0.0


def sample_forward_flops(model: ModelSpec, workload: WorkloadSpec, modality: str) -> tuple[float, float, float]:
    """(decoder layers, LM head, encoder) forward FLOPs for one mean-length sample of a modality."""
    seq = workload.sequence_tokens(model, modality)[0]
    head = seq * 2 * model.hidden_size * model.vocab_size
    layers = seq * decoder_forward_flops_per_token(model, seq) - head
    return layers, head, _encoder_forward_flops(model, workload, modality)


def step_flops(model: ModelSpec, workload: WorkloadSpec, *, recompute: str = "none", train: bool = True) -> float:
    """FLOPs for one optimizer step's samples.

    Training is 3× the forward (backward = 2× forward; Kaplan et al. 2020, 6·N·tokens); full recomputation
    re-runs the transformer layers' forward, 4× for them but still 3× for the LM head (Narayanan et al.
    2021, §5.1: 96·B·s·l·h²·(1 + s/6h + V/16lh)). Frozen encoders run forward only.
    """
    passes = (4 if recompute == "full" else 3) if train else 1
    head_passes = 3 if train else 1
    encoder_passes = passes if train and workload.train_encoders else 1
    total = 0.0
    for modality in workload.active_modalities():
        layers, head, encoder = sample_forward_flops(model, workload, modality)
        share = workload.modality_mix[modality] * workload.samples_per_step
        total += share * (passes * layers + head_passes * head + encoder_passes * encoder)
    return total


def mean_sequence_tokens(model: ModelSpec, workload: WorkloadSpec) -> float:
    """Expected LLM tokens per sample over the modality mix."""
    return sum(workload.modality_mix[m] * workload.sequence_tokens(model, m)[0] for m in workload.active_modalities())


def training_step_time(
    model: ModelSpec,
    workload: WorkloadSpec,
    cluster: ClusterSpec,
    cfg: ParallelConfig,
    trainable_bytes: float,
    *,
    train: bool = True,
) -> TimeBreakdown:
    """Predicted step time of a training (or forward-only scoring) service.

    Args:
        model: The model.
        workload: The step's samples.
        cluster: Hardware.
        cfg: Parallel layout.
        trainable_bytes: bf16 gradient bytes per GPU to reduce over data parallel ranks.
        train: Forward + backward (+ optimizer) when True; forward only otherwise.
    """
    m = cfg.micro_batches(workload.samples_per_step)
    compute = step_flops(model, workload, recompute=cfg.recompute, train=train) / (cfg.world_size * cluster.flops_per_s)
    bubble = compute * pipeline_bubble_fraction(cfg.pp, m)
    seq = mean_sequence_tokens(model, workload)
    tokens = seq * cfg.micro_batch / cfg.cp  # tokens per micro-batch on one rank  # [b · s/cp]
    act_bytes = tokens * model.hidden_size * BF16
    layers = model.num_layers / cfg.pp

    # Megatron TP: 2 all-reduces per layer forward and 2 backward (Shoeybi et al. 2019, §3; Narayanan et al.
    # 2021, §3.2); sequence parallelism swaps each for all-gather + reduce-scatter of equal volume
    # (Korthikanti et al. 2022, §4.2.2). Full recomputation repeats the forward pair.
    n_ar = (4 + (2 if cfg.recompute == "full" else 0)) if train else 2
    tp_comm = (
        m * layers * n_ar * ring_allreduce_seconds(act_bytes, cfg.tp, cluster.link_gbps(cfg.tp), cluster.latency_s)
    )

    # Stage boundaries: one activation send forward and one gradient send backward per micro-batch, each
    # s·b·h·2 bytes (Narayanan et al. 2021, §3.2: point-to-point between consecutive stages).
    pp_gbps = cluster.link_gbps(cfg.tp * cfg.cp * cfg.dp * min(cfg.pp, 2))
    pp_send = cluster.latency_s + act_bytes / (pp_gbps * 1e9)
    pp_comm = (2 if train else 1) * m * pp_send if cfg.pp > 1 else 0.0

    # Gradients reduce over dp · cp ranks (megatron-core averages over the data-and-context group); a ring
    # all-reduce, or reduce-scatter + all-gather under the distributed optimizer, moves 2(n−1)/n of them.
    dp_n = cfg.dp * cfg.cp
    dp_comm = ring_allreduce_seconds(trainable_bytes, dp_n, cluster.link_gbps(cfg.tp * dp_n), cluster.latency_s)
    dp_comm = dp_comm if train else 0.0

    # Context parallelism as ring attention (Liu et al. 2023; megatron-core CP): per layer, cp − 1 hops each
    # pass a K/V block of 2·(s/cp)·b·kv·d·2 bytes forward; backward passes K/V and dK/dV (3× total). It
    # overlaps with block-wise attention compute, so only the excess is exposed.
    cp_comm = 0.0
    if cfg.cp > 1:
        kv_block = 2 * tokens * model.num_kv_heads * model.head_dim * BF16
        hops = (3 if train else 1) * (cfg.cp - 1)
        ring = hops * (cluster.latency_s + kv_block / (cluster.link_gbps(cfg.tp * cfg.cp) * 1e9))
        attn = (3 if train else 1) * 4 * seq * tokens * model.num_heads * model.head_dim / cfg.tp
        cp_comm = m * layers * max(0.0, ring - attn / cluster.flops_per_s)

    # Expert parallelism (Lepikhin et al. 2020, GShard): dispatch and combine all-to-alls per MoE layer,
    # forward and backward; each rank sends (ep − 1)/ep of its k·tokens·h routed activations.
    ep_comm = 0.0
    if model.is_moe and cfg.ep > 1:
        routed = tokens / cfg.tp * model.experts_top_k * model.hidden_size * BF16
        a2a = (cfg.ep - 1) * cluster.latency_s + routed * (cfg.ep - 1) / cfg.ep / (
            cluster.link_gbps(cfg.tp * cfg.ep) * 1e9
        )
        ep_comm = m * layers * (4 if train else 2) * a2a
    return TimeBreakdown(compute, bubble, tp_comm, pp_comm, dp_comm, cp_comm, ep_comm)


@dataclass(frozen=True)
class GenerationEstimate:
    """Predicted rollout behaviour of one inference replica.

    Attributes:
        concurrency: Sequences decoded together (KV-cache bound).
        prefill_s: Prefill seconds per step for this replica's share of samples.
        decode_step_s: Seconds per decode step at full concurrency.
        sync_s: Step time when every wave waits for its longest sample (synchronous RL).
        async_s: Step time with continuous batching, i.e. mean-length cost (asynchronous RL).
    """

    concurrency: int
    prefill_s: float
    decode_step_s: float
    sync_s: float
    async_s: float


def generation_estimate(
    model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec, tp: int, replicas: int, concurrency: int
) -> GenerationEstimate:
    """Rollout time for one step's samples on `replicas` engines of `tp` GPUs each.

    Decode is memory-bandwidth bound at RL batch sizes (Pope et al. 2022, "Efficiently Scaling Transformer
    Inference"): a step reads every weight and the live KV cache once, so it costs
    max(bytes / HBM bandwidth, FLOPs / sustained FLOP/s) plus two TP all-reduces per layer. Prefill is
    compute bound. A synchronous step waits max_response_tokens decode steps per wave; continuous batching
    pays only the mean length.
    """
    samples = math.ceil(workload.samples_per_step / replicas)
    seq_mean = mean_sequence_tokens(model, workload)
    prompt = seq_mean - workload.response_tokens
    prefill = 0.0
    for modality in workload.active_modalities():
        share = workload.modality_mix[modality] * samples
        prompt_m = workload.sequence_tokens(model, modality)[0] - workload.response_tokens
        flops = prompt_m * decoder_forward_flops_per_token(model, prompt_m) + _encoder_forward_flops(
            model, workload, modality
        )
        prefill += share * flops / (tp * cluster.flops_per_s)
    context = prompt + workload.response_tokens / 2
    read = inference_weight_bytes(model, tp) - BF16 * model.encoder_params()
    read += concurrency * context * kv_cache_bytes_per_token(model, tp)
    flops = concurrency * decoder_forward_flops_per_token(model, context) / tp
    step = max(read / (cluster.hbm_gbps * 1e9), flops / cluster.flops_per_s)
    if tp > 1:
        msg = concurrency * model.hidden_size * BF16
        step += 2 * model.num_layers * ring_allreduce_seconds(msg, tp, cluster.link_gbps(tp), cluster.latency_s)
    waves = math.ceil(samples / concurrency)
    sync = prefill + waves * workload.max_response_tokens * step
    asynchronous = prefill + math.ceil(samples * workload.response_tokens / concurrency) * step
    return GenerationEstimate(concurrency, prefill, step, sync, asynchronous)
