"""A whole Qwen2.5-Omni folder, as published (``architectures: ["Qwen2_5OmniModel"]``, the thinker's config under
``thinker_config``, thinker weights under ``thinker.`` beside the talker's), trains as its thinker.

The folder here is the default tiny thinker wrapped the way the published checkpoints and transformers'
``Qwen2_5OmniForConditionalGeneration.save_pretrained`` lay it out, plus a stand-in talker weight; the reference is
the thinker folder itself: the same ids, the same logits, the same rendered prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from relax_modalities.synthetic import MediaRef, TaskItem
from relax_services.config import ModelConfig
from relax_services.data.run_data import PromptBuilder
from relax_services.models import (
    CheckpointError,
    load_model,
    open_checkpoint,
    tiny_omni_checkpoint,
    validate_checkpoint,
)
from relax_services.models.families import CONTAINERS, FAMILIES

THINKER = tiny_omni_checkpoint(0)


def _whole(tmp_path: Path, architecture: str) -> Path:
    dest = tmp_path / architecture
    shutil.copytree(THINKER, dest)
    thinker = json.loads((THINKER / "config.json").read_text())
    whole = {
        "architectures": [architecture],
        "model_type": "qwen2_5_omni",
        "enable_audio_output": True,
        "thinker_config": {k: v for k, v in thinker.items() if k != "architectures"},
    }
    (dest / "config.json").write_text(json.dumps(whole))
    weights = {f"thinker.{k}": v for k, v in load_file(str(THINKER / "model.safetensors")).items()}
    weights["talker.model.embed_tokens.weight"] = torch.full((4, 4), 7.0)  # a part relax does not load
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("architecture", sorted(CONTAINERS))
def test_a_whole_omni_folder_loads_as_its_thinker(tmp_path: Path, architecture: str) -> None:
    folder = _whole(tmp_path, architecture)
    ours, reference = validate_checkpoint(folder), open_checkpoint(THINKER)
    assert ours.family is FAMILIES["Qwen2_5OmniThinkerForConditionalGeneration"]
    assert ours.tokens == reference.tokens  # placeholder, eos and pad ids read from the thinker's config
    model, plain = load_model(folder), load_model(THINKER)
    assert type(model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert not any(name.startswith("talker") for name, _ in model.named_parameters())
    ids = torch.tensor([reference.tokenizer.encode("3+4=", add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=0, rtol=0)


def test_prompts_render_as_the_thinker_folders(tmp_path: Path) -> None:
    folder = _whole(tmp_path, "Qwen2_5OmniModel")
    image = tmp_path / "red.png"
    Image.new("RGB", (56, 56), (255, 0, 0)).save(image)
    item = TaskItem(id="i", task="image", prompt="which colour? r g", media=(MediaRef("image", str(image)),))
    ours = PromptBuilder(ModelConfig(source=str(folder)))(item)
    reference = PromptBuilder(ModelConfig(source=str(THINKER)))(item)
    assert ours.input_ids.tolist() == reference.input_ids.tolist()
    torch.testing.assert_close(ours.pixel_values, reference.pixel_values, atol=0, rtol=0)


def test_a_whole_folder_without_the_part_config_is_refused(tmp_path: Path) -> None:
    folder = _whole(tmp_path, "Qwen2_5OmniModel")
    config = json.loads((folder / "config.json").read_text())
    del config["thinker_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="Qwen2_5OmniModel without 'thinker_config'"):
        validate_checkpoint(folder)
