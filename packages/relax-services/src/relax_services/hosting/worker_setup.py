"""What every Ray worker process of a run does before it loads any actor: keep triton out where no GPU exists.

transformers imports ``torch._dynamo`` at the top of ``masking_utils``, which every model class imports, and
``torch._dynamo`` imports triton whenever the package is installed (``torch.utils._triton.has_triton_package`` and
``torch._dynamo.utils`` try ``import triton``; torch has no setting or environment variable that skips it). The
CUDA torch wheel from PyPI pulls triton in, so a model process on a CPU-only machine loads a GPU kernel compiler it
can never use: ≈ 74 MB of private memory in each model process (``benchmarks/import_footprint.py``).

Python's import system has a documented way to say "this module is absent": a ``None`` in ``sys.modules`` makes
``import triton`` raise ``ModuleNotFoundError`` and ``importlib.util.find_spec("triton")`` return ``None`` (the
language reference, *The module cache*). That is exactly what torch and transformers see on a CPU-only torch wheel,
which has no triton: both probe for it and take their no-triton path, so a model runs as it does there.

It is done only where no GPU can be visible to the process (no NVIDIA, AMD or WSL GPU device or driver on the
machine): on a machine with a GPU, every process — a CPU-only role's too — keeps today's imports. The check reads
device paths only; it neither imports torch nor initialises a GPU driver (a CUDA call here would make a later
``fork`` of the process unsafe for CUDA). ``RELAX_KEEP_TRITON=1`` in the environment turns it off (e.g. for a
triton build with a CPU backend).

:func:`setup_worker` is the run's Ray ``worker_process_setup_hook`` (see ``_ray_init``): Ray calls it in each worker
before the worker loads an actor class or deserialises arguments, so it covers service actors, shared hosts and
Trainer-group ranks alike. It imports nothing heavy: the queue, weight-store and monitor actors run it too.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Sequence

__all__ = ["GPU_DEVICE_PATHS", "KEEP_TRITON_ENV", "WORKER_SETUP_HOOK", "gpu_present", "keep_triton_out", "setup_worker"]

GPU_DEVICE_PATHS: tuple[str, ...] = (
    "/proc/driver/nvidia",  # the NVIDIA kernel driver is loaded
    "/dev/nvidiactl",
    "/dev/nvidia[0-9]*",
    "/dev/kfd",  # AMD ROCm
    "/dev/dri/renderD*",  # any GPU with a render node (Intel XPU, AMD)
    "/dev/dxg",  # a GPU passed through to WSL
)
"""Paths (glob patterns) any of which existing means a GPU may be visible to a process on this machine."""

KEEP_TRITON_ENV = "RELAX_KEEP_TRITON"
"""Environment variable: ``1`` keeps triton importable even where no GPU is present."""

WORKER_SETUP_HOOK = f"{__name__}.setup_worker"
"""The import path Ray's ``runtime_env["worker_process_setup_hook"]`` takes (a string: no function is pickled)."""

_BLOCKED = "triton"


def gpu_present(paths: Sequence[str] = GPU_DEVICE_PATHS) -> bool:
    """Whether any of ``paths`` (glob patterns) exists: a GPU device or driver this process could see."""
    return any(glob.glob(pattern) for pattern in paths)


def keep_triton_out(paths: Sequence[str] = GPU_DEVICE_PATHS) -> bool:
    """Make ``import triton`` fail in this process when no GPU is present; returns whether it now does.

    Nothing changes (False) where a GPU device or driver exists (``paths``, see :func:`gpu_present`), where
    ``RELAX_KEEP_TRITON=1``, or where triton is imported already (it cannot be unloaded); it is True also where
    triton was blocked before (idempotent). Modules imported afterwards see triton as not installed.
    """
    if os.environ.get(KEEP_TRITON_ENV) == "1":
        return False
    if _BLOCKED in sys.modules:
        return sys.modules[_BLOCKED] is None
    if gpu_present(paths):
        return False
    sys.modules[_BLOCKED] = None  # type: ignore[assignment]  # None marks a module as absent (import system)
    return True


def setup_worker() -> None:
    """The Ray worker setup hook of a run: :func:`keep_triton_out` (it cannot fail, so it never ends a worker)."""
    keep_triton_out()
