"""``trainer.layout=auto``: relax-parallel's planner chooses the Trainer group's mesh, and the run realises it.

The planner (:func:`relax_parallel.plan_training`) gets the model from the checkpoint's ``config.json``, the workload
from the first rows of the training files (their modality mix, prompt lengths in the checkpoint's tokens, image
sizes and audio lengths) with ``rollout.max_new_tokens`` and the step's samples, and the devices of the run; it
searches only the layouts the FSDP engine executes (data, sequence and tensor parallelism: no pipeline stages,
experts or recomputation; ``sp × tp`` dividing the attention heads). Its choice is written into the
run config as ``trainer.tensor_parallel`` and ``trainer.sequence_parallel`` (the plan's ``tp`` and ``cp``), so
everything after (validation, the group's mesh, the saved config a resume reads) sees one layout. A degree given
explicitly wins: the planner then searches only layouts with it.

:func:`layout_text` is the one description ``relax plan``, ``relax train --dry-run`` and the run's summary print.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from relax_modalities import DataRecord
    from relax_parallel import ClusterSpec, ModelSpec, ParallelConfig, ParallelPlan, WorkloadSpec
    from relax_services.config import RunConfig

__all__ = [
    "ASSUMED_VIDEO_FRAMES",
    "AUTO_ROWS",
    "data_workload",
    "device_cluster",
    "first_records",
    "layout_text",
    "plan_layout",
    "realisable",
]

AUTO_ROWS = 64
"""Training rows the workload is read from."""

ASSUMED_VIDEO_FRAMES = 32
"""Frames of a video row whose item does not say (``nframes`` in its metadata): decoding videos to count them is
what the planner must not wait for."""

_DEGREES = {"tp": "tensor_parallel", "cp": "sequence_parallel"}


def realisable(model: ModelSpec, fixed: dict[str, int]) -> Callable[[ParallelConfig], bool]:
    """The layouts the FSDP Trainer group executes: pp = ep = 1, no recomputation, no vision-encoder split, ``tp × cp``
    (tensor × Ulysses sequence parallelism) dividing the attention heads, and the degrees in ``fixed`` (plan
    dimension → degree) as given."""

    def ok(cfg: ParallelConfig) -> bool:
        return (
            cfg.pp == 1
            and cfg.ep == 1
            and cfg.recompute == "none"
            and not cfg.vision_tp
            and model.num_heads % (cfg.tp * cfg.cp) == 0
            and all(getattr(cfg, dim) == n for dim, n in fixed.items())
        )

    return ok


def _modality(record: DataRecord) -> str:
    """The modality a row counts for in the mix: its most expensive media kind (video, image, audio), else text."""
    kinds = {m.kind for m in record.media}
    return next((k for k in ("video", "image", "audio") if k in kinds), "text")


def _image_size(item: object) -> tuple[int, int] | None:
    from PIL import Image

    path, data = getattr(item, "path", None), getattr(item, "data", None)
    try:
        with Image.open(path if path is not None else io.BytesIO(data or b"")) as image:
            width, height = image.size
    except (OSError, ValueError):
        return None  # the loader reports the file; the planner goes on without its size
    return height, width


def _audio_seconds(item: object) -> float | None:
    import soundfile

    path, data = getattr(item, "path", None), getattr(item, "data", None)
    try:
        info = soundfile.info(path if path is not None else io.BytesIO(data or b""))
    except (RuntimeError, ValueError, TypeError):
        return None
    return float(info.duration)


def _token_count(tokenizer: Tokenizer, text: str) -> int:
    """Tokens of ``text`` under the checkpoint's tokenizer; a character per token where it cannot encode the text (a
    word-level vocabulary without an unknown token, as the tiny checkpoints' own)."""
    try:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)
    except Exception:
        return len(text)


def _mean(values: Sequence[float], default: float) -> float:
    return sum(values) / len(values) if values else default


def data_workload(cfg: RunConfig, records: Sequence[DataRecord], folder: Path) -> WorkloadSpec:
    """The step's workload from ``records`` (the first training rows): modality mix, mean prompt tokens (the
    checkpoint's tokenizer on the prompt text), mean image size and audio length, video frames from the items'
    ``nframes`` (else :data:`ASSUMED_VIDEO_FRAMES`); responses of ``rollout.max_new_tokens`` at most, half that
    on average; ``trainer.groups_per_step`` prompts of ``algorithm.group_size`` samples.

    Raises:
        ValueError: If ``records`` is empty.
    """
    from tokenizers import Tokenizer

    from relax_parallel import WorkloadSpec

    if not records:
        raise ValueError("trainer.layout=auto: the training files have no readable row to plan for")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    counts: dict[str, int] = {}
    tokens, sizes, seconds, frames = [], [], [], []
    for record in records:
        kind = _modality(record)
        counts[kind] = counts.get(kind, 0) + 1
        text = "".join(m.text for m in record.messages)
        tokens.append(_token_count(tokenizer, text))
        for item in record.media:
            if item.kind == "image" and (size := _image_size(item)) is not None:
                sizes.append(size)
            elif item.kind == "audio" and (duration := _audio_seconds(item)) is not None:
                seconds.append(duration)
            elif item.kind == "video":
                frames.append(float(item.meta.get("nframes", ASSUMED_VIDEO_FRAMES)))
    new = cfg.rollout.max_new_tokens
    defaults = WorkloadSpec()
    return WorkloadSpec(
        modality_mix={k: n / len(records) for k, n in counts.items()},
        prompt_tokens=max(1, round(_mean(tokens, 1))),
        response_tokens=max(1, new // 2),
        max_response_tokens=max(1, new),
        image_size=(
            (round(_mean([s[0] for s in sizes], 0)), round(_mean([s[1] for s in sizes], 0)))
            if sizes
            else defaults.image_size
        ),
        video_frames=max(1, round(_mean(frames, ASSUMED_VIDEO_FRAMES))),
        audio_seconds=_mean(seconds, defaults.audio_seconds),
        prompts_per_step=cfg.trainer.groups_per_step,
        group_size=cfg.algorithm.group_size,
        train_encoders=True,  # relax trains the whole model, encoders included
    )


def first_records(cfg: RunConfig, rows: int = AUTO_ROWS) -> list[DataRecord]:
    """The first ``rows`` rows of the training files (the synthetic tasks' files when none are given), in file order."""
    from relax_modalities import build_stream
    from relax_services.data.synthetic import with_synthetic_files

    data = with_synthetic_files(cfg).data
    return list(islice(build_stream(data.train_files, data.schema_, shuffle_buffer=0, epochs=1), rows))


def _device_memory_gib(cfg: RunConfig) -> tuple[float, str]:
    """Memory per Trainer rank (GiB) and where the figure comes from: the first GPU's (``nvidia-smi``) on a CUDA
    run, else the host's memory shared by the ranks."""
    import subprocess

    from relax_services.config.devices import device_of

    if device_of(cfg, "trainer") == "cuda":
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
            return float(out.split()[0]) / 1024, "GPU memory (nvidia-smi)"
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return 80.0, "GPU memory unknown, 80 GiB assumed"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return host / cfg.trainer.world_size, f"host memory / {cfg.trainer.world_size} ranks"


def device_cluster(cfg: RunConfig) -> tuple[ClusterSpec, str]:
    """The Trainer's devices as relax-parallel's cluster (one node of ``trainer.world_size`` devices), and the
    source of its memory figure."""
    from relax_parallel import ClusterSpec

    memory, source = _device_memory_gib(cfg)
    world = cfg.trainer.world_size
    return ClusterSpec(num_gpus=world, gpus_per_node=world, gpu_memory_gib=memory), source


def plan_layout(
    cfg: RunConfig,
    folder: Path,
    records: Sequence[DataRecord] | None = None,
    cluster: ClusterSpec | None = None,
) -> tuple[RunConfig, ParallelPlan | None]:
    """``cfg`` with the planner's ``tensor_parallel`` and ``sequence_parallel`` when ``trainer.layout='auto'``, and
    the plan (None for a given layout, or when both degrees are given explicitly).

    Args:
        cfg: The run config.
        folder: The model checkpoint's folder (its ``config.json`` and ``tokenizer.json``).
        records: The rows to plan for (default: :func:`first_records`).
        cluster: The devices (default: :func:`device_cluster`).

    Raises:
        ValueError: If the model's config cannot be read, or no layout the engine executes fits
            (:class:`relax_parallel.InfeasiblePlanError`, naming what and by how much).
    """
    from relax_parallel import load_model_spec, plan_training
    from relax_services.config.trainer_group import check_trainer_group

    trainer = cfg.trainer
    if trainer.layout != "auto":
        return cfg, None
    fixed = {dim: getattr(trainer, field) for dim, field in _DEGREES.items() if field in trainer.model_fields_set}
    if len(fixed) == len(_DEGREES):
        return cfg, None  # an explicit layout wins
    model = load_model_spec(folder / "config.json")
    workload = data_workload(cfg, first_records(cfg) if records is None else records, folder)
    if cluster is None:
        cluster, _ = device_cluster(cfg)
    plan = plan_training(model, workload, cluster, world_size=trainer.world_size, allowed=realisable(model, fixed))
    update = {field: getattr(plan.config, dim) for dim, field in _DEGREES.items()}
    # The degrees become given ones (a resumed run reads them back and keeps this layout), and the rules of
    # trainer.world_size are checked again with them.
    resolved = cfg.model_copy(update={"trainer": trainer.model_copy(update=update)})
    check_trainer_group(resolved)
    return resolved, plan


def layout_text(cfg: RunConfig, plan: ParallelPlan | None) -> str:
    """The Trainer's plan text (:func:`~relax_services.engines.trainer_plan.trainer_plan_text`) and, when the
    planner chose the layout, what it chose from and why: the one description ``relax plan``, ``relax train
    --dry-run`` and the run's summary print."""
    from relax_services.engines.trainer_plan import trainer_plan_text

    text = trainer_plan_text(cfg)
    if plan is None:
        return text
    lines = [
        f"  - layout chosen by relax-parallel (trainer.layout=auto): tp={plan.tp} sp(cp)={plan.cp} dp={plan.dp}; "
        f"predicted {plan.memory.total / 2**30:.3g} GiB per rank of {plan.memory_limit / 2**30:.3g} usable, "
        f"{plan.step_time_s:.3g} s per step",
        f"    binding: {plan.binding_constraint}",
        *(f"    {line}" for line in plan.explanation),
    ]
    return "\n".join([text, *lines])
