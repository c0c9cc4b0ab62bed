"""Benchmark of the Trainer group's layouts: per layout (dp 2, sp 2, tp 2 on two CPU ranks over gloo), the peak
memory per rank and the seconds per update for a long-text, an image-heavy or a video-heavy batch
(:data:`WORKLOADS`), side by side with relax-parallel's predictions for the same layout and workload, so the cost
model is checked against measurement.

Run: ``relax bench parallel [--workload text|image|video] [--tokens 2048] [--updates 2]
[--layouts dp2 sp2 tp2]``. Each layout is a fresh group of
spawned processes on this machine; the figures are measured, never asserted (the machine may be loaded). The
predictions are the cost model's for GPUs (bf16 weights, mixed-precision Adam) on a cluster of this machine's
memory per rank and an assumed CPU throughput (:data:`CPU_TFLOPS`): their error against a float32 CPU run is the
point of printing them, not a claim either way.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the models load in the benchmark's processes, not when the CLI parses its options
    import torch

    from relax_parallel import ParallelConfig
    from relax_services.engines.protocols import LossInputs, TrainSample
    from relax_services.models.inputs import OmniPrompt

LAYOUTS: dict[str, dict[str, int]] = {"dp2": {"dp": 2}, "sp2": {"cp": 2}, "tp2": {"tp": 2}}
"""Layouts of two ranks benchmarked, as :class:`relax_parallel.ParallelConfig` degrees (sp is the plan's cp)."""

SAMPLES = 2  # per update: one per data-parallel rank at dp 2
RESPONSE_TOKENS = 16
WORKLOADS = ("text", "image", "video")
"""A batch's kind: ``text`` (prompts of ``--tokens`` tokens), ``image`` (:data:`IMAGES` images of
:data:`IMAGE_SIDE` pixels a side per sample, then :data:`MEDIA_TEXT_TOKENS` text tokens), ``video`` (one video of
:data:`VIDEO_FRAMES` frames of :data:`VIDEO_SIDE` pixels a side per sample, then the same text)."""
IMAGES, IMAGE_SIDE = 8, 224  # 16 × 16 patches of 14 px each: 64 tokens per image after the 2 × 2 merge
VIDEO_FRAMES, VIDEO_SIDE = 32, 112  # 16 temporal patches (2 frames each) of 8 × 8: 256 tokens
MEDIA_TEXT_TOKENS = 32
_PATCH = 14
_PATCH_DIM = 3 * 2 * _PATCH * _PATCH  # channels · temporal patch · patch · patch
CPU_TFLOPS = 0.05
"""Assumed dense float32 throughput of one CPU rank (TFLOP/s) for the predictions (one core with AVX2)."""


@dataclass(frozen=True)
class LayoutFigures:
    """Measured and predicted figures of one layout.

    Attributes:
        layout: Its name (a :data:`LAYOUTS` key).
        peak_mib: Largest growth of a rank's resident memory over its size before the first update (MiB).
        s_per_update: Seconds per timed update.
        predicted_mib: relax-parallel's memory per rank (MiB).
        predicted_s: relax-parallel's seconds per update.
    """

    layout: str
    peak_mib: float
    s_per_update: float
    predicted_mib: float
    predicted_s: float


def layout_config(name: str) -> ParallelConfig:
    """The :class:`relax_parallel.ParallelConfig` of a :data:`LAYOUTS` name."""
    from relax_parallel import ParallelConfig

    degrees = LAYOUTS[name]
    return ParallelConfig(dp=degrees.get("dp", 1), cp=degrees.get("cp", 1), tp=degrees.get("tp", 1))


def predict(name: str, tokens: int, workload_kind: str = "text") -> tuple[float, float]:
    """relax-parallel's ``(bytes per rank, seconds per update)`` for the tiny thinker at layout ``name`` on a batch
    of :data:`SAMPLES` prompts of ``workload_kind`` (:data:`WORKLOADS`; ``tokens`` text tokens for ``text``)."""
    from relax_parallel import ClusterSpec, WorkloadSpec, load_model_spec, training_memory, training_step_time
    from relax_services.models.tiny_omni import tiny_omni_checkpoint

    spec = load_model_spec(tiny_omni_checkpoint(0) / "config.json")
    workload = WorkloadSpec(
        prompt_tokens=tokens if workload_kind == "text" else MEDIA_TEXT_TOKENS,
        response_tokens=RESPONSE_TOKENS,
        max_response_tokens=RESPONSE_TOKENS,
        image_size=(IMAGE_SIDE, IMAGE_SIDE),
        images_per_sample=IMAGES,
        video_frames=VIDEO_FRAMES,
        video_size=(VIDEO_SIDE, VIDEO_SIDE),
        prompts_per_step=SAMPLES,
        group_size=1,
        modality_mix={workload_kind: 1.0},
    )
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cluster = ClusterSpec(num_gpus=2, gpus_per_node=2, gpu_memory_gib=host / 2, peak_tflops=CPU_TFLOPS, mfu=1.0)
    cfg = layout_config(name)
    memory = training_memory(spec, workload, cfg, workload_kind)
    return memory.total, training_step_time(spec, workload, cluster, cfg, memory.gradients).total


def media_prompt(kind: str, gen: torch.Generator) -> OmniPrompt:
    """One prompt of the ``image`` or ``video`` workload: random patches of the sizes :data:`WORKLOADS` names, its
    placeholders, then :data:`MEDIA_TEXT_TOKENS` text tokens."""
    import torch

    from relax_services.models.checkpoint import DEFAULT_SOURCE, open_checkpoint
    from relax_services.models.inputs import OmniPrompt

    ph = open_checkpoint(DEFAULT_SOURCE).tokens.placeholders
    text = torch.randint(12, 48, (MEDIA_TEXT_TOKENS,), generator=gen).tolist()
    if kind == "image":
        side = IMAGE_SIDE // _PATCH
        block = [ph["vision_start"], *[ph["image"]] * (side * side // 4), ph["vision_end"]] * IMAGES
        media = {
            "pixel_values": torch.randn(IMAGES * side * side, _PATCH_DIM, generator=gen),
            "image_grid_thw": torch.tensor([[1, side, side]] * IMAGES),
        }
    elif kind == "video":
        side, t = VIDEO_SIDE // _PATCH, VIDEO_FRAMES // 2
        block = [ph["vision_start"], *[ph["video"]] * (t * side * side // 4), ph["vision_end"]]
        media = {
            "pixel_values_videos": torch.randn(t * side * side, _PATCH_DIM, generator=gen),
            "video_grid_thw": torch.tensor([[t, side, side]]),
            "video_second_per_grid": torch.tensor([1.0]),
        }
    else:
        raise ValueError(f"workload must be image or video here, got {kind!r}")
    return OmniPrompt(input_ids=torch.tensor([*block, *text], dtype=torch.long), **media)


def _batch(tokens: int, seed: int, workload_kind: str = "text") -> list[TrainSample]:
    import torch

    from relax_services.engines.protocols import TrainSample
    from relax_services.models.inputs import OmniPrompt

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(SAMPLES):
        if workload_kind == "text":
            prompt = OmniPrompt(torch.randint(12, 48, (tokens,), generator=gen))
        else:
            prompt = media_prompt(workload_kind, gen)
        response = torch.randint(12, 48, (RESPONSE_TOKENS,), generator=gen)
        out.append(TrainSample(prompt, response, {"advantages": torch.randn(RESPONSE_TOKENS, generator=gen)}))
    return out


def _loss(inputs: LossInputs) -> torch.Tensor:
    return -(inputs.logprobs * inputs.fields["advantages"] * inputs.mask).sum() / inputs.mask.sum()


def _resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(rank: int, world: int, folder: str, name: str, tokens: int, updates: int, workload_kind: str) -> None:
    import torch
    import torch.distributed as dist

    from relax_parallel import ParallelPlan
    from relax_services.engines.fsdp.train import FSDPTrainEngine
    from relax_services.engines.torch.train import TorchTrainConfig
    from relax_services.models import build_tiny_omni

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        layout = layout_config(name)
        mesh = ParallelPlan.from_config(layout).device_mesh("cpu")
        engine = FSDPTrainEngine(
            build_tiny_omni(0),
            TorchTrainConfig(micro_batch_size=1),
            mesh=mesh["dp"],
            tp_mesh=mesh["tp"] if layout.tp > 1 else None,
            sp_mesh=mesh["cp"],
        )
        batches = [_batch(tokens, s, workload_kind) for s in range(updates + 1)]
        before = _resident_bytes()
        engine.step(batches[0], _loss)  # warm-up: first forwards allocate and initialise lazily
        dist.barrier()
        start = time.perf_counter()
        for b in batches[1:]:
            engine.step(b, _loss)
        seconds = (time.perf_counter() - start) / updates
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # ru_maxrss: KiB on Linux
        Path(folder, f"rank{rank}.json").write_text(json.dumps({"peak": max(peak, 0), "seconds": seconds}))
    finally:
        dist.destroy_process_group()


def measure(name: str, tokens: int = 2048, updates: int = 2, workload_kind: str = "text") -> LayoutFigures:
    """Runs ``updates`` timed updates (after one warm-up) at layout ``name`` on a fresh group of two processes, on
    batches of ``workload_kind`` (:data:`WORKLOADS`)."""
    from torch.multiprocessing.spawn import start_processes

    with tempfile.TemporaryDirectory() as folder:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        start_processes(  # type: ignore[no-untyped-call]
            _worker, args=(2, folder, name, tokens, updates, workload_kind), nprocs=2, start_method="spawn"
        )
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(2)]
    predicted_bytes, predicted_s = predict(name, tokens, workload_kind)
    return LayoutFigures(
        layout=name,
        peak_mib=max(r["peak"] for r in ranks) / 2**20,
        s_per_update=max(r["seconds"] for r in ranks),
        predicted_mib=predicted_bytes / 2**20,
        predicted_s=predicted_s,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared with ``relax bench parallel``)."""
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="text",
        help=f"text (--tokens per prompt), image ({IMAGES} × {IMAGE_SIDE} px per prompt) or video "
        f"({VIDEO_FRAMES} frames of {VIDEO_SIDE} px per prompt)",
    )
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens of each of the batch's 2 sequences")
    parser.add_argument("--updates", type=int, default=2, help="timed updates per layout (after one warm-up)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")


def run(args: argparse.Namespace) -> list[LayoutFigures]:
    """Measures and prints the table for ``args.layouts``."""
    kind = getattr(args, "workload", "text")
    what = {
        "text": f"text sequences of {args.tokens} + {RESPONSE_TOKENS} tokens",
        "image": f"prompts of {IMAGES} images of {IMAGE_SIDE} px + {MEDIA_TEXT_TOKENS} text, {RESPONSE_TOKENS} new",
        "video": f"prompts of a {VIDEO_FRAMES}-frame {VIDEO_SIDE} px video + {MEDIA_TEXT_TOKENS} text, "
        f"{RESPONSE_TOKENS} new",
    }[kind]
    print(f"tiny thinker, {SAMPLES} {what} tokens per update, 2 ranks")
    header = ("layout", "peak MiB", "pred MiB", "s/update", "pred s", "mem err", "time err")
    print("{:7} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}".format(*header))
    rows = []
    for name in args.layouts:
        f = measure(name, args.tokens, args.updates, kind)
        rows.append(f)
        mem_err = f.predicted_mib / f.peak_mib - 1 if f.peak_mib > 0 else float("nan")
        time_err = f.predicted_s / f.s_per_update - 1
        print(
            f"{f.layout:7} {f.peak_mib:9.1f} {f.predicted_mib:9.1f} {f.s_per_update:9.3f} {f.predicted_s:9.4f} "
            f"{mem_err:+8.0%} {time_err:+8.0%}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n", encoding="utf-8")
    return rows
