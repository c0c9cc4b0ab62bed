"""The intra-op thread count an engine computes with.

Torch splits large CPU reductions (the weight gradients of layer norms and linear layers over many rows, sums
over long dimensions) into one partial sum per intra-op thread and adds the partials, so the same inputs give
results that differ in the last bits between thread counts. Measured on the tiny omni model: one update on
4 images of 16 × 16 patches at 1 and at 2 threads gives different vision-tower weights (the text decoder's
reductions are too small to be split). A process's count comes from its environment (``OMP_NUM_THREADS``, the
CPU count), so two processes computing "the same" update, e.g. the Trainer service and a synchronous
reference loop in a process launched differently, disagree. The engines therefore set the count they compute
with themselves.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_INTRA_OP_THREADS", "check_threads", "configure_process", "pin_intra_op_threads"]

DEFAULT_INTRA_OP_THREADS = 1
"""One thread per process: every service computes with it, and under CPU contention more threads per process
made forwards 20-50 × slower (DESIGN.md)."""


def check_threads(owner: str, threads: int | None) -> None:
    """Raise ``ValueError`` naming ``owner`` unless ``threads`` is None or >= 1."""
    if threads is not None and threads < 1:
        raise ValueError(f"{owner}.intra_op_threads must be >= 1 or None, got {threads}")


def pin_intra_op_threads(threads: int | None) -> None:
    """Set the process's intra-op thread count to ``threads`` (None: leave it as it is).

    The count is process-wide in torch (threads started later inherit it), so this is a setting of the process,
    made by the engine that computes in it; it is cheap when the count is already right.
    """
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def configure_process() -> None:
    """Per-process settings every service and trainer rank applies first: one torch thread (robust under CPU
    contention)."""
    torch.set_num_threads(1)
