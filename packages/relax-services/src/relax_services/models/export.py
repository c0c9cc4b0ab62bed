"""Hugging Face export of one run checkpoint: the policy (and the critic, with its value head) as checkpoint
folders that ``transformers`` (and vLLM) load directly, with the tokenizer, chat template and processor files of
the run's model folder. The walk over a run's checkpoints is :mod:`relax_services.control.export`."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_services._files import ENGINE_FILE
from relax_services.models.checkpoint import copy_side_files, open_checkpoint
from relax_services.models.lora import ADAPTER_FOLDER, apply_lora, load_adapter_state, merged_state, save_adapter

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch
    from transformers import PreTrainedModel

    from relax_services.config import ModelConfig

__all__ = ["HF_FOLDER", "export_checkpoint"]

HF_FOLDER = "hf"
"""Name of the Hugging Face folder written inside every checkpoint folder."""


def _save(model: PreTrainedModel, state: Mapping[str, torch.Tensor], source: Path, out: Path) -> None:
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out)  # safetensors
    copy_side_files(source, out)


def export_checkpoint(checkpoint_dir: str | Path, model: ModelConfig, out_dir: str | Path) -> Path:
    """Writes run checkpoint ``checkpoint_dir``'s policy to ``out_dir`` in Hugging Face format.

    ``out_dir`` gets the policy's ``config.json``, ``generation_config.json``, ``model.safetensors`` and the model
    folder's tokenizer / chat template / processor files; with a critic, ``out_dir/critic`` gets the critic's
    backbone the same way plus ``value_head.safetensors``. Written beside and renamed into place, so ``out_dir``
    is complete or absent. With ``model.lora`` the checkpoint holds adapters: ``out_dir`` gets the merged model
    (``W + (alpha / rank) · B A``, a plain checkpoint folder) and ``out_dir/adapter`` the adapters in peft's format
    (``peft.PeftModel.from_pretrained(base, out_dir / "adapter")``).

    Args:
        checkpoint_dir: A run checkpoint folder (``checkpoints/step_N``): its trainer engine state is read.
        model: The run's model config (its folder gives the architecture, tokenizer and processor files).
        out_dir: Folder to write; replaced when it exists.

    Returns:
        ``out_dir``.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    state: dict[str, Any] = torch.load(Path(checkpoint_dir) / ENGINE_FILE, map_location="cpu", weights_only=False)
    ckpt = open_checkpoint(model.source, model.seed)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if model.lora is None:
        _save(ckpt.load_model(), state["model"], ckpt.path, tmp)
    else:  # the checkpoint holds adapters: the merged model, and the adapters in peft's format beside it
        adapted = apply_lora(ckpt.load_model(), model.lora)
        load_adapter_state(adapted, state["model"])
        _save(ckpt.load_model(), merged_state(adapted), ckpt.path, tmp)
        save_adapter(adapted, model.lora, tmp / ADAPTER_FOLDER, ckpt.path)
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
