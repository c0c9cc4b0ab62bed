"""``relax train --dry-run``: where every process of a run would go, and whether its model fits the device there.

The config and the cluster are resolved as a run resolves them (:func:`~relax_services.control.launch.
resolve_devices`: the device, the GPU counts against Ray's), the run's placement groups are created and probed
(:func:`~relax_services.hosting.placement.probe_placement`: a zero-CPU actor in each bundle reports its node and GPU
ids), and relax-parallel's memory model estimates each process's device memory from the checkpoint's
``config.json``. No model is loaded and no service starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from relax_services.config.devices import DeviceError, device_of
from relax_services.config.trainer_group import GROUP_TRAIN_ENGINES, data_parallel, rank_split
from relax_services.hosting.placement import ProcessSlot, SlotSite, probe_placement, run_processes

if TYPE_CHECKING:
    from relax_parallel import ModelSpec, WorkloadSpec
    from relax_services.config import RunConfig

__all__ = ["ASSUMED_PROMPT_TOKENS", "DryRunRow", "dry_run", "dry_run_rows", "format_dry_run", "process_memory"]

ASSUMED_PROMPT_TOKENS = 256
"""Prompt length the memory estimates assume (the config bounds answers, not prompts)."""

GIB = 2**30


@dataclass(frozen=True)
class DryRunRow:
    """One process of the dry run's table."""

    slot: ProcessSlot
    site: SlotSite | None
    device: str
    memory: float | None
    """Estimated bytes on each of its devices (None: no estimate, e.g. the tiny default model or a CPU process)."""


def _model_spec(cfg: RunConfig) -> ModelSpec | None:
    from relax_parallel import load_model_spec

    config = Path(str(cfg.model.source)).expanduser() / "config.json"
    if not config.is_file():
        return None  # the tiny default model (written on first use): a few MB
    try:
        return load_model_spec(config)
    except (ValueError, KeyError, json.JSONDecodeError):
        return None


def _workload(cfg: RunConfig) -> WorkloadSpec:
    from relax_parallel import WorkloadSpec

    new = cfg.rollout.max_new_tokens
    return WorkloadSpec(
        prompt_tokens=ASSUMED_PROMPT_TOKENS,
        response_tokens=new,
        max_response_tokens=new,
        prompts_per_step=cfg.trainer.groups_per_step,
        group_size=cfg.algorithm.group_size,
    )


def process_memory(cfg: RunConfig, slot: ProcessSlot, spec: ModelSpec, device_bytes: int | None) -> float:
    """relax-parallel's estimate of one process's bytes per device: a training role's model states, activations and
    logits (``training_memory``), a scoring role's forward pass, a rollout engine's weights plus its KV cache (vLLM
    on GPU takes ``gpu_memory_utilization`` of the device whatever it needs); a host's roles add up."""
    from relax_parallel import ParallelConfig, inference_weight_bytes, kv_cache_bytes_per_token, training_memory

    workload = _workload(cfg)
    _, per_rank = rank_split(cfg)
    micro = max(1, min(cfg.trainer.micro_batch_groups * cfg.algorithm.group_size, per_rank))
    total = 0.0
    for role in slot.roles:
        if role == "trainer" and (
            slot.process.startswith("trainer-rank-") or cfg.trainer.engine not in GROUP_TRAIN_ENGINES
        ):
            layout = ParallelConfig(
                dp=data_parallel(cfg),
                tp=cfg.trainer.tensor_parallel,
                cp=cfg.trainer.sequence_parallel,
                micro_batch=micro,
            )
            total += training_memory(spec, workload, layout, "text").total
        elif role == "critic":
            total += training_memory(spec, workload, ParallelConfig(micro_batch=micro), "text").total
        elif role == "reference":
            total += training_memory(spec, workload, ParallelConfig(micro_batch=micro), "text", forward_only=True).total
        elif role in ("rollout", "eval"):
            tp = max(1, int(slot.gpus))
            if cfg.rollout.engine == "vllm" and device_bytes is not None:
                total += cfg.rollout.vllm.gpu_memory_utilization * device_bytes
                continue
            rows = cfg.rollout_call_groups * cfg.algorithm.group_size
            tokens = rows * (ASSUMED_PROMPT_TOKENS + cfg.rollout.max_new_tokens)
            total += inference_weight_bytes(spec, tp) + kv_cache_bytes_per_token(spec, tp) * tokens
    return total


def dry_run_rows(cfg: RunConfig, namespace: str) -> list[DryRunRow]:
    """Every process of the run (``cfg`` resolved, Ray up) with where it lands and its memory estimate."""
    sites = probe_placement(cfg, namespace)
    spec = _model_spec(cfg)
    rows = []
    for slot in run_processes(cfg):
        site = sites.get(slot.process)
        computing = [r for r in slot.roles if r != "reward"]
        device = "cuda" if slot.gpus > 0 else ("cpu" if computing else "-")
        memory = None
        if spec is not None and computing and device == "cuda":
            memory = process_memory(cfg, slot, spec, None if site is None else site.device_memory)
        rows.append(DryRunRow(slot, site, device, memory))
    return rows


def format_dry_run(cfg: RunConfig, rows: list[DryRunRow]) -> str:
    """The dry run's table: per process, its roles, node, GPU ids, dtype and memory estimate against the device's."""
    lines = [
        f"[placement] run.device={cfg.run.device}, run.mode={cfg.run.mode}: "
        f"{sum(r.slot.gpus for r in rows):g} GPU(s) reserved over {len(rows)} process(es), "
        f"run.threads={cfg.run.threads} torch thread(s) per computing service",
        f"  {'process':<38} {'roles':<30} {'node':<16} {'GPUs':<10} {'dtype':<17} "
        "memory per device (estimate / device)",
    ]
    for row in rows:
        slot, site = row.slot, row.site
        if slot.gpus > 0 and site is not None:
            node, gpus = site.node, ",".join(site.gpu_ids) or "?"
            gpus = f"{gpus} ({slot.gpus:g})" if slot.gpus < 1 else gpus
        else:
            node, gpus = "(Ray places)", "-"
        memory = "-"
        if row.memory is not None:
            have = site.device_memory if site is not None else None
            against = f"{have / GIB:.1f} GiB" if have is not None else "device memory unknown"
            verdict = "" if have is None else ("  fits" if row.memory <= have else "  DOES NOT FIT")
            memory = f"{row.memory / GIB:.2f} GiB / {against}{verdict}"
        elif row.device == "cuda":
            memory = "no estimate (no config.json to read: the tiny default model is a few MB)"
        roles = ",".join(slot.roles)
        lines.append(f"  {slot.process:<38} {roles:<30} {node:<16} {gpus:<10} {slot.dtype:<17} {memory}")
    if device_of(cfg, "trainer") == "cuda":
        lines.append(
            f"  estimates: relax-parallel's memory model (bf16 weights, mixed-precision Adam), prompts of "
            f"{ASSUMED_PROMPT_TOKENS} tokens, answers of rollout.max_new_tokens={cfg.rollout.max_new_tokens}"
        )
    return "\n".join(lines)


def dry_run(cfg: RunConfig) -> str:
    """Resolve ``cfg`` against the cluster (starting or joining Ray as the run would, and stopping a Ray it
    started) and return the placement table; nothing is loaded or started.

    Raises:
        LaunchError: as :func:`~relax_services.control.launch.resolve_devices` (and an unreachable cluster).
    """
    from relax_services.config.threads import with_threads
    from relax_services.control.launch import LaunchError, machine_cores, resolve_devices

    if cfg.run.mode == "colocated":
        resolved = with_threads(resolve_devices(cfg), machine_cores(cfg))
        device = device_of(resolved, "trainer")
        return (
            f"[placement] run.mode=colocated, run.device={resolved.run.device}: every role is a thread of this "
            f"process, computing on {device}"
            + (" (its first visible GPU)" if device == "cuda" else "")
            + f", {resolved.run.threads} torch thread(s) each"
        )
    from relax_services.hosting.ray_init import init_ray

    try:
        started = init_ray(cfg.run.ray_address)
    except ConnectionError as exc:
        raise LaunchError(str(exc)) from exc
    try:
        resolved = with_threads(resolve_devices(cfg), machine_cores(cfg))
        try:
            rows = dry_run_rows(resolved, "relax-dry-run")
        except DeviceError as exc:  # the groups could not be placed
            raise LaunchError(str(exc)) from exc
        return format_dry_run(resolved, rows)
    finally:
        if started:
            import ray

            ray.shutdown()
