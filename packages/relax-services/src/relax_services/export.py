"""Hugging Face export of a run's checkpoints: the policy (and the critic, with its value head) as checkpoint
folders that ``transformers`` (and vLLM) load directly, with the tokenizer, chat template and processor files of
the run's model folder."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from relax_services.checkpoint import CheckpointManager
from relax_services.config import ModelConfig, load_run_config
from relax_services.models import copy_side_files, open_checkpoint

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch
    from transformers import PreTrainedModel

__all__ = ["HF_FOLDER", "export_checkpoint", "export_run"]

HF_FOLDER = "hf"
"""Name of the Hugging Face folder written inside every checkpoint folder."""


def _save(model: PreTrainedModel, state: Mapping[str, torch.Tensor], source: Path, out: Path) -> None:
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out)  # safetensors
    copy_side_files(source, out)


def export_checkpoint(checkpoint_dir: str | Path, model: ModelConfig, out_dir: str | Path) -> Path:
    """Writes checkpoint ``checkpoint_dir``'s policy to ``out_dir`` in Hugging Face format.

    ``out_dir`` gets the policy's ``config.json``, ``generation_config.json``, ``model.safetensors`` and the model
    folder's tokenizer / chat template / processor files; with a critic, ``out_dir/critic`` gets the critic's
    backbone the same way plus ``value_head.safetensors``. Written beside and renamed into place, so ``out_dir``
    is complete or absent.

    Args:
        checkpoint_dir: A run checkpoint folder (``checkpoints/step_N``).
        model: The run's model config (its folder gives the architecture, tokenizer and processor files).
        out_dir: Folder to write; replaced when it exists.

    Returns:
        ``out_dir``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    state = CheckpointManager.load_engine(Path(checkpoint_dir))
    ckpt = open_checkpoint(model.source, model.seed)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _save(ckpt.load_model(), state["model"], ckpt.path, tmp)
    critic = state.get("critic")
    if critic is not None:
        weights = critic["model"]
        backbone = {k.removeprefix("thinker."): v for k, v in weights.items() if k.startswith("thinker.")}
        _save(ckpt.load_model(), backbone, ckpt.path, tmp / "critic")
        head = {
            k.removeprefix("value_head."): v.contiguous() for k, v in weights.items() if k.startswith("value_head.")
        }
        save_file(head, str(tmp / "critic" / "value_head.safetensors"))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


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
    return export_checkpoint(path, model, out_dir)
