"""``relax-plan``: a model, a workload and a cluster in; a parallel plan table out.

Example::

    relax-plan --model qwen2.5-omni-7b --gpus 16 --gpu-mem 80 --video 0.3
"""

from __future__ import annotations

import argparse
import sys

from relax_parallel._hf_config import PRESETS, load_model_spec
from relax_parallel._search import InfeasiblePlanError, plan_training
from relax_parallel._specs import ClusterSpec, ModelSpec, WorkloadSpec
from relax_parallel._split import ALGORITHMS, split_services

# GPU id -> (peak dense bf16 TFLOP/s, HBM GB/s, intra-node GB/s per GPU), from vendor data sheets.
GPUS: dict[str, tuple[float, float, float]] = {
    "h100": (989.0, 3350.0, 300.0),
    "h200": (989.0, 4800.0, 300.0),
    "a100": (312.0, 2039.0, 240.0),
}


def _size(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEIGHTxWIDTH such as 448x448, got {text!r}") from None
    return h, w


def build_parser(prog: str = "relax-plan") -> argparse.ArgumentParser:
    """The argument parser (reusable by a parent CLI as a sub-command)."""
    p = argparse.ArgumentParser(prog=prog, description="Plan parallelism for relax services.")
    p.add_argument("--model", required=True, help=f"preset ({', '.join(PRESETS)}) or path to a config.json")
    g = p.add_argument_group("cluster")
    g.add_argument("--gpus", type=int, required=True, help="total GPUs")
    g.add_argument("--gpu-mem", type=float, default=80.0, help="memory per GPU, GiB (default 80)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    g.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="GPU type for speeds (default h100)")
    g.add_argument("--inter-node-gbps", type=float, default=50.0, help="per-GPU cross-node GB/s (default 50)")
    g.add_argument("--mfu", type=float, default=0.4, help="achievable fraction of peak FLOP/s (default 0.4)")
    w = p.add_argument_group("workload (modality fractions; text takes the rest)")
    for modality in ("image", "video", "audio"):
        w.add_argument(f"--{modality}", type=float, default=0.0, help=f"fraction of {modality} samples")
    w.add_argument("--prompt-tokens", type=int, default=512)
    w.add_argument("--response-tokens", type=int, default=1024, help="mean generated tokens")
    w.add_argument("--max-response-tokens", type=int, default=4096)
    w.add_argument("--image-size", type=_size, default=(448, 448), help="HxW pixels")
    w.add_argument("--video-frames", type=int, default=128)
    w.add_argument("--video-size", type=_size, default=(448, 448), help="HxW pixels")
    w.add_argument("--audio-seconds", type=float, default=30.0)
    w.add_argument("--prompts-per-step", type=int, default=32)
    w.add_argument("--group-size", type=int, default=8)
    w.add_argument("--train-encoders", action="store_true", help="update the encoders (default: frozen)")
    s = p.add_argument_group("services")
    s.add_argument("--tau", type=float, default=2.0, help="staleness bound τ (default 2)")
    s.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="grpo")
    s.add_argument("--no-split", action="store_true", help="only plan training on all GPUs")
    return p


def _specs(args: argparse.Namespace) -> tuple[ModelSpec, WorkloadSpec, ClusterSpec]:
    model = load_model_spec(args.model)
    mix = {m: getattr(args, m) for m in ("image", "video", "audio") if getattr(args, m) > 0}
    text = 1.0 - sum(mix.values())
    if text < -1e-9:
        raise ValueError(f"modality fractions sum to {1 - text:.2f} > 1")
    if text > 1e-9:
        mix["text"] = text
    workload = WorkloadSpec(
        modality_mix=mix,
        prompt_tokens=args.prompt_tokens,
        response_tokens=args.response_tokens,
        max_response_tokens=args.max_response_tokens,
        image_size=args.image_size,
        video_frames=args.video_frames,
        video_size=args.video_size,
        audio_seconds=args.audio_seconds,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        train_encoders=args.train_encoders,
    )
    peak, hbm, nvlink = GPUS[args.gpu]
    cluster = ClusterSpec(
        num_gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_gib=args.gpu_mem,
        peak_tflops=peak,
        hbm_gbps=hbm,
        intra_node_gbps=nvlink,
        inter_node_gbps=args.inter_node_gbps,
        mfu=args.mfu,
    )
    return model, workload, cluster


def _header(model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec) -> str:
    enc = []
    if model.vision:
        enc.append(f"vision {model.vision.num_params() / 1e9:.2f} B")
    if model.audio:
        enc.append(f"audio {model.audio.num_params() / 1e9:.2f} B")
    moe = f", {model.num_experts} experts top-{model.experts_top_k}" if model.is_moe else ""
    mix = ", ".join(f"{m} {workload.modality_mix[m]:.0%}" for m in workload.active_modalities())
    longest = max(workload.active_modalities(), key=lambda m: workload.sequence_tokens(model, m)[1])
    nodes = max(1, cluster.num_gpus // cluster.gpus_per_node)
    return "\n".join(
        [
            f"model    {model.name}: {model.total_params() / 1e9:.2f} B parameters "
            f"(LLM {model.llm_params() / 1e9:.2f} B{moe}{'; ' if enc else ''}{', '.join(enc)})",
            f"workload {workload.samples_per_step} samples/step ({workload.prompts_per_step} prompts × "
            f"{workload.group_size}); {mix}; longest {longest} sample "
            f"{workload.sequence_tokens(model, longest)[1]:,} tokens",
            f"cluster  {cluster.num_gpus} × {cluster.gpu_memory_gib:g} GiB ({nodes} node(s)), "
            f"{cluster.peak_tflops:g} TFLOP/s peak at MFU {cluster.mfu:g}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Run the planner CLI.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        0 on success, 2 when the request is invalid or does not fit.
    """
    args = build_parser().parse_args(argv)
    try:
        model, workload, cluster = _specs(args)
        print(_header(model, workload, cluster))
        print(f"\n== training on all {cluster.num_gpus} GPUs (colocated, synchronous)")
        print(plan_training(model, workload, cluster).table())
        if not args.no_split:
            split = split_services(model, workload, cluster, tau=args.tau, algorithm=args.algorithm)
            print("\n== " + split.table())
            if not split.colocated:
                for plan in split.plans.values():
                    print()
                    print(plan.table())
    except (InfeasiblePlanError, ValueError) as err:
        print(f"relax-plan: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
