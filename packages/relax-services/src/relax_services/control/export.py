"""Hugging Face export of a run's checkpoints (``relax export``): the walk over a run folder to one checkpoint, which
:func:`relax_services.models.export.export_checkpoint` writes."""

from __future__ import annotations

from pathlib import Path

from relax_services.config import load_run_config
from relax_services.control.checkpoint import CheckpointManager

__all__ = ["export_run"]


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    """Exports checkpoint ``step`` of a run folder (default: its newest complete one) to ``out_dir``.

    The run's model folder is its format warm-up's (``warmup_model``) when it has one, else ``model.source`` of
    its saved ``config.yaml``.

    Raises:
        FileNotFoundError: naming the run folder or the missing step.
    """
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"{run} is not a run folder (no config.yaml)")
    cfg = load_run_config(run / "config.yaml")
    manager = CheckpointManager(run / "checkpoints")
    if step is None:
        path = manager.latest()
        if path is None:
            raise FileNotFoundError(f"{run / 'checkpoints'} holds no complete checkpoint")
    else:
        if step not in manager.steps():
            raise FileNotFoundError(
                f"{run / 'checkpoints'} has no complete checkpoint of step {step}: {manager.steps()}"
            )
        path = manager.path(step)
    model = cfg.model
    if (run / "warmup_model" / "config.json").is_file():
        model = model.model_copy(update={"source": str(run / "warmup_model")})
    from relax_services.models.export import export_checkpoint  # the model stack: only here, not in `relax`

    return export_checkpoint(path, model, out_dir)
