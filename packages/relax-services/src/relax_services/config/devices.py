"""Run-config rules of devices: which device each role computes on, how many GPUs its process reserves, and the
dtype of its model; light (no torch at import), as the config must load without the model stack.

``run.device`` is ``auto``, ``cpu`` or ``cuda``. ``auto`` is resolved once, by the launch, against what the cluster
reports (:func:`resolve_device`): the resolved value is what every process of the run reads, so a role never
decides on its own. A role computes on CUDA when the run's device is ``cuda`` and its GPU count is above zero; a
process's visible devices are the ones Ray gave it (``CUDA_VISIBLE_DEVICES``), so the role's device is ``cuda``
(its first visible device) whatever GPU ids it holds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Literal

import pydantic

if TYPE_CHECKING:
    from relax_services.config import RunConfig

__all__ = [
    "GPU_ROLES",
    "Device",
    "DeviceChoice",
    "DeviceError",
    "Dtype",
    "GpuCount",
    "check_gpu_count",
    "device_of",
    "dtype_of",
    "gpu_field",
    "resolve_device",
    "role_gpus",
    "trainer_autocast",
    "whole_gpus",
    "with_device",
]

DeviceChoice = Literal["auto", "cpu", "cuda"]
Device = Literal["cpu", "cuda"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


GPU_ROLES: dict[str, str] = {
    "trainer": "trainer.gpus_per_rank",
    "rollout": "rollout.gpus",
    "reference": "reference.gpus",
    "critic": "critic.gpus",
    "eval": "eval.gpus",
}
"""The roles that compute with a model, and the field of each one's GPU count (per process: per Trainer rank, per
Rollout worker). The Reward computes on the CPU."""


class DeviceError(ValueError):
    """A run asks for devices the cluster does not have (the message names the field, what was asked and what Ray
    reports)."""


def check_gpu_count(value: float) -> float:
    """A GPU count Ray can reserve: a fraction up to one (processes share the device) or a whole number.

    Raises:
        ValueError: a negative count, or a fraction above one (Ray reserves whole GPUs beyond one).
    """
    if value < 0 or (value > 1 and not float(value).is_integer()):
        raise ValueError("a GPU count is a fraction up to 1 (processes share a device) or a whole number")
    return value


GpuCount = Annotated[float, pydantic.AfterValidator(check_gpu_count)]
"""A GPU count field of the run config (:func:`check_gpu_count`)."""


def gpu_field(role: str) -> str:
    """The config field of ``role``'s GPU count (``rollout`` → ``rollout.gpus``)."""
    return GPU_ROLES[role]


def role_gpus(cfg: RunConfig, role: str) -> float:
    """GPUs one process of ``role`` computes on (0 for the Reward, and for every role of a CPU run)."""
    if role not in GPU_ROLES or _run_device(cfg) != "cuda":
        return 0.0
    section, _, field = GPU_ROLES[role].partition(".")
    return float(getattr(getattr(cfg, section), field))


def device_of(cfg: RunConfig, role: str) -> Device:
    """The torch device ``role`` computes on: ``cuda`` when the run's device is and the role reserves GPUs."""
    return "cuda" if role_gpus(cfg, role) > 0 else "cpu"


def dtype_of(cfg: RunConfig, role: str) -> Literal["float32", "bfloat16", "float16"]:
    """The dtype of ``role``'s model weights. ``auto``: bfloat16 for the roles that only read the policy (rollout,
    reference, eval) on CUDA, float32 on the CPU; the trainer and the critic keep float32 weights (their compute
    dtype is :func:`trainer_autocast`'s)."""
    if role in ("trainer", "critic"):
        return "float32"
    chosen: str = getattr(getattr(cfg, role), "dtype", "auto") if role in GPU_ROLES else "auto"
    if chosen == "auto":
        return "bfloat16" if device_of(cfg, role) == "cuda" else "float32"
    return chosen  # type: ignore[return-value]  # a Dtype other than auto (the field's Literal)


def trainer_autocast(cfg: RunConfig) -> Literal["auto", "bf16", "off"]:
    """The trainer's compute precision from ``trainer.dtype``: ``auto`` is bfloat16 autocast over float32 master
    weights on a CUDA device that supports it, float32 on the CPU."""
    modes: dict[str, Literal["auto", "bf16", "off"]] = {"auto": "auto", "bfloat16": "bf16", "float32": "off"}
    return modes[cfg.trainer.dtype]


def _run_device(cfg: RunConfig) -> Device:
    """The run's device; ``auto`` not resolved by a launch (engines built by hand) is ``cuda`` when torch sees one."""
    device = cfg.run.device
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: DeviceChoice, gpus: float, *, source: str) -> Device:
    """``run.device`` against the GPUs the cluster has.

    Args:
        requested: The configured ``run.device``.
        gpus: GPUs the cluster reports.
        source: Who reported ``gpus`` (for the message), e.g. ``"Ray"`` or ``"torch in this process"``.

    Raises:
        DeviceError: ``cuda`` asked on a cluster without GPUs.
    """
    if requested == "auto":
        return "cuda" if gpus > 0 else "cpu"
    if requested == "cuda" and gpus <= 0:
        raise DeviceError(f"run.device='cuda', but {source} reports no GPU; use run.device=cpu or auto")
    return requested


def with_device(cfg: RunConfig, device: Device) -> RunConfig:
    """``cfg`` with ``run.device`` set to the resolved ``device``."""
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"device": device})})


def whole_gpus(value: float) -> int:
    """GPUs a count spans: 1 for a fraction, the count itself otherwise."""
    return max(1, math.ceil(value)) if value > 0 else 0
