"""Published checkpoints' own configuration files (``tests/fixtures/published``, weight sizes shrunk) go through
relax's model path as a user's folder would: ids from the checkpoint, the chat template its processor renders, and
as many image tokens as its processor gives.

The reference side is transformers' processor code: the chat template as its processor loader reads it
(``ProcessorMixin.get_processor_dict``), rendered by the function its ``apply_chat_template`` calls
(``render_jinja_template``), each image placeholder expanded as its ``__call__`` does (``grid.prod() // merge²``
copies), and the token count of its ``_get_num_multimodal_tokens`` (the image processor's
``get_number_of_image_patches // merge²``). ``AutoProcessor`` itself cannot be built here: transformers 5.20's Qwen VL
processors require their video processor, which requires torchvision, not installed in this workspace.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Qwen2_5_VLProcessor
from transformers.utils.chat_template_utils import render_jinja_template

from relax_modalities.synthetic import MediaRef, TaskItem
from relax_services.config import ModelConfig
from relax_services.data.run_data import PromptBuilder
from relax_services.models import DEFAULT_SOURCE, CheckpointError, load_model, open_checkpoint, validate_checkpoint

_spec = importlib.util.spec_from_file_location("_published", Path(__file__).with_name("_published.py"))
assert _spec is not None and _spec.loader is not None
_published_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_published_module)
FIXTURES: Path = _published_module.FIXTURES
published_folder = _published_module.published_folder

VL = "qwen2.5-vl-3b-instruct"


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return published_folder(VL, tmp_path_factory.mktemp("published") / VL)


def _published(name: str, file: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((FIXTURES / name / file).read_text())
    return data


def test_ids_come_from_the_published_files(vl_folder: Path) -> None:
    ckpt = open_checkpoint(vl_folder)
    assert ckpt.family.name == "qwen2.5-vl"
    config = _published(VL, "config.json")
    assert ckpt.tokens.placeholders == {
        "image": config["image_token_id"],
        "video": config["video_token_id"],
        "vision_start": config["vision_start_token_id"],
        "vision_end": config["vision_end_token_id"],
    }
    assert ckpt.tokens.placeholders == {"image": 151655, "video": 151656, "vision_start": 151652, "vision_end": 151653}
    generation = _published(VL, "generation_config.json")
    assert ckpt.tokens.eos_ids == tuple(generation["eos_token_id"]) == (151645, 151643)  # type: ignore[arg-type]
    assert ckpt.tokens.pad_id == generation["pad_token_id"] == 151643
    assert ckpt.tokens.vocab_size == config["vocab_size"] == 151936
    # Never sampled: every special added token of the published tokenizer config but the eos ids; its non-special
    # added tokens (<tool_call>, the fill-in-the-middle markers) stay sampleable.
    added = _published(VL, "tokenizer_config.json")["added_tokens_decoder"]
    specials = {int(i) for i, t in added.items() if t["special"]}  # type: ignore[union-attr]
    assert set(ckpt.tokens.never_sample) == specials - {151645, 151643}
    assert 151657 not in ckpt.tokens.never_sample and 151655 in ckpt.tokens.never_sample


def test_the_processors_chat_template_is_used(vl_folder: Path) -> None:
    ckpt = open_checkpoint(vl_folder)
    template = _published(VL, "chat_template.json")["chat_template"]
    assert not (vl_folder / "chat_template.jinja").exists() and "chat_template" not in _published(
        VL, "tokenizer_config.json"
    )  # the published files carry the template for the processor only
    assert ckpt.has_chat_template and ckpt.tokenizer.chat_template == template


def test_a_bad_processor_chat_template_file_is_named(tmp_path: Path, vl_folder: Path) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    for f in vl_folder.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "chat_template.json").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"template": "x"}))
    with pytest.raises(CheckpointError, match=rf"{folder / 'chat_template.json'}: expected a 'chat_template' string"):
        validate_checkpoint(folder)


def _image(tmp_path: Path, height: int, width: int) -> Path:
    path = tmp_path / f"{height}x{width}.png"
    rng = np.random.default_rng(height * 7919 + width)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


@pytest.mark.parametrize(("height", "width"), [(480, 640), (720, 1280), (224, 224), (20, 30), (1000, 37)])
def test_image_prompt_equals_the_processors(tmp_path: Path, vl_folder: Path, height: int, width: int) -> None:
    ckpt = open_checkpoint(vl_folder)
    path = _image(tmp_path, height, width)
    item = TaskItem(id="i", task="image", prompt="which colour? r g", media=(MediaRef("image", str(path)),))
    prompt = PromptBuilder(ModelConfig(source=str(vl_folder)))(item)

    # The processor's side.
    processor_dict, _ = Qwen2_5_VLProcessor.get_processor_dict(str(vl_folder), local_files_only=True)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which colour? r g"}]}]
    rendered, _ = render_jinja_template(
        [messages], chat_template=processor_dict["chat_template"], add_generation_prompt=True
    )
    assert rendered[0] == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>which colour? r g<|im_end|>\n<|im_start|>assistant\n"
    )
    image_processor = AutoImageProcessor.from_pretrained(vl_folder, local_files_only=True)
    pixels = image_processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")
    merge = image_processor.merge_size**2
    n_tokens = int(pixels["image_grid_thw"].prod()) // merge
    assert n_tokens == image_processor.get_number_of_image_patches(height, width, {}) // merge
    expanded = rendered[0].replace("<|image_pad|>", "<|image_pad|>" * n_tokens)
    reference_ids = ckpt.tokenizer(expanded, add_special_tokens=False)["input_ids"]

    assert int((prompt.input_ids == 151655).sum()) == n_tokens
    assert prompt.input_ids.tolist() == reference_ids
    assert prompt.image_grid_thw is not None and prompt.pixel_values is not None
    assert prompt.image_grid_thw.tolist() == pixels["image_grid_thw"].tolist()
    torch.testing.assert_close(prompt.pixel_values, pixels["pixel_values"].float(), atol=1e-5, rtol=0)


def test_published_folder_loads_and_runs(vl_folder: Path, tmp_path: Path) -> None:
    model = load_model(vl_folder)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert model.config.text_config.rope_parameters["mrope_section"] == [16, 24, 24]  # as published: head_dim 128
    path = _image(tmp_path, 56, 84)
    item = TaskItem(id="i", task="image", prompt="which colour? r g", media=(MediaRef("image", str(path)),))
    prompt = PromptBuilder(ModelConfig(source=str(vl_folder)))(item)
    ids = prompt.input_ids[None]
    media = {k: v for k, v in prompt.media().items() if k != "video_second_per_grid"}
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == 151655).int(), **media
        ).logits
    assert logits.shape == (1, ids.shape[1], 151936) and torch.isfinite(logits).all()


@pytest.mark.parametrize(("height", "width"), [(1080, 1920), (480, 640)])
def test_omni_published_pixel_budget_is_the_image_processors(tmp_path: Path, height: int, width: int) -> None:
    # A 1080p image is above the default folder's 1003520 px budget and below the published 12845056 px one: the
    # prompt must follow the published preprocessor config, as the image processor it configures does.
    folder = tmp_path / "omni"
    shutil.copytree(open_checkpoint(DEFAULT_SOURCE).path, folder)
    shutil.copy2(FIXTURES / "qwen2.5-omni-processor" / "preprocessor_config.json", folder / "preprocessor_config.json")
    path = _image(tmp_path, height, width)
    item = TaskItem(id="i", task="image", prompt="which colour? r g", media=(MediaRef("image", str(path)),))
    prompt = PromptBuilder(ModelConfig(source=str(folder)))(item)
    image_processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    assert image_processor.size == {"shortest_edge": 3136, "longest_edge": 12845056}
    pixels = image_processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")
    n_tokens = image_processor.get_number_of_image_patches(height, width, {}) // image_processor.merge_size**2
    placeholder = open_checkpoint(folder).tokens.placeholders["image"]
    assert int((prompt.input_ids == placeholder).sum()) == n_tokens
    assert prompt.image_grid_thw is not None and prompt.pixel_values is not None
    assert prompt.image_grid_thw.tolist() == pixels["image_grid_thw"].tolist()
    torch.testing.assert_close(prompt.pixel_values, pixels["pixel_values"].float(), atol=1e-5, rtol=0)
