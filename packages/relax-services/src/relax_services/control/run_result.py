"""What a finished run reports (:class:`RunResult`), and the error of a checkpoint that could not be written."""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax_services.control.checkpoint import CheckpointManager
    from relax_services.data.feeder import Ledger

__all__ = ["CheckpointWriteError", "RunResult", "final_ledger"]


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full or read-only disk): the run stops, its partial folder removed."""

    def __init__(self, folder: Path, step: int, latest: Path | None, exc: OSError) -> None:
        self.folder, self.step, self.latest, self.cause = folder, step, latest, exc
        full = exc.errno == errno.ENOSPC
        what = "the disk is full" if full else (exc.strerror or str(exc))
        try:
            free = f"{shutil.disk_usage(folder).free / 2**20:.0f} MiB free"
        except OSError:
            free = "free space unknown"
        resume = (
            f"the last complete checkpoint is {latest.name}: free space, then continue with --resume"
            if latest is not None
            else "no complete checkpoint yet: free space and start the run again"
        )
        super().__init__(f"checkpoint of step {step} not written under {folder}: {what} ({free}); {resume}")


@dataclass
class RunResult:
    """What a finished run reports."""

    run_dir: Path
    steps: int
    wall_s: float
    stop_reason: str
    final_eval: dict[str, float]
    chance: dict[str, float]
    ledger: dict[str, int]
    health_events: list[dict[str, Any]] = field(default_factory=list)
    samples: int = 0
    trainer_wait_s: float = 0.0
    train_s: float = 0.0
    rollout_s: float = 0.0
    staleness_hist: dict[int, int] = field(default_factory=dict)
    first_step_reaching: dict[str, float] = field(default_factory=dict)
    warmup_steps: int = 0
    service_pids: dict[str, int] = field(default_factory=dict)
    service_nodes: dict[str, str] = field(default_factory=dict)
    skipped_media: dict[str, dict[str, int]] = field(default_factory=dict)
    final_version: int | None = None  # policy version whose held-out reward final_eval is
    first_eval: dict[str, float] = field(default_factory=dict)  # held-out reward of the run's earliest evaluation
    first_eval_version: int | None = None  # the version first_eval scores (None: no evaluation before the end)
    target_reward: float | None = None  # trainer.target_reward of the run
    target_version: int | None = None  # the version whose evaluation met target_reward and stopped the run
    resume_changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # overrides on --resume: (saved, new)
    resumed_from_s: float = 0.0  # run time already spent before this --resume (included in wall_s)
    startup: dict[str, float] = field(default_factory=dict)  # start-up phase -> seconds since the run began
    error: str | None = None  # why the run ended early with an error (e.g. a disk full at a checkpoint)
    data: dict[str, Any] | None = None  # dataset files' report (bad rows, held-out sources); None: synthetic tasks


def final_ledger(checkpoints: CheckpointManager, live: Ledger | None) -> dict[str, int]:
    """The ledger of the run's final checkpoint, with ``lost``: prompts neither consumed, regenerated, nor still
    held by a queue snapshot of that checkpoint (without a checkpoint: the ``live`` feeder's ledger, if any)."""
    from relax_services.control.checkpoint import queued_prompt_keys
    from relax_services.data.feeder import Ledger

    path = checkpoints.latest()
    if path is None:
        return (live or Ledger()).check()
    ledger = Ledger()
    ledger.load_state_dict(checkpoints.load_controller(path)["feeder"]["ledger"])
    counts = ledger.check()
    held = queued_prompt_keys(path)
    pending = [k for k in ledger.generated if k not in ledger.consumed and k not in ledger.requeued]
    counts["lost"] = sum(1 for k in pending if k not in held)
    return counts
