"""Checkpoint folders: the default one is an ordinary Hugging Face folder, bad folders fail early with clear errors,
and prompts are rendered by the checkpoint's own chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from relax_modalities.synthetic import MediaRef, TaskItem
from relax_services.config import ModelConfig, load_run_config
from relax_services.data.run_data import PromptBuilder, prepare_data
from relax_services.models import (
    DEFAULT_SOURCE,
    FAMILIES,
    CheckpointError,
    UnsupportedArchitectureError,
    families,
    load_model,
    open_checkpoint,
    validate_checkpoint,
)
from relax_services.models.tiny_families import write_tiny_checkpoint

CKPT = open_checkpoint(DEFAULT_SOURCE)


def _copy(tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(CKPT.path, dest)
    return dest


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    for dotted, value in changes.items():
        node = config
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    (path / "config.json").write_text(json.dumps(config))


def test_default_checkpoint_loads_with_plain_transformers_auto_classes() -> None:
    files = {p.name for p in CKPT.path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    model = AutoModelForImageTextToText.from_pretrained(CKPT.path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(CKPT.path, local_files_only=True)
    ids = torch.tensor([tokenizer.encode("3+4=", add_special_tokens=False)])
    ours = load_model(CKPT.path)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ours(input_ids=ids).logits, atol=0, rtol=0)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert CKPT.family is FAMILIES["Qwen2_5OmniThinkerForConditionalGeneration"]


def test_missing_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        validate_checkpoint(tmp_path / "nope")


def test_folder_without_tokenizer_is_rejected(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{path}: no tokenizer"):
        validate_checkpoint(path)


def test_unknown_architecture_names_it_and_the_supported_list(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    _edit_config(path, architectures=["MistralForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="'MistralForCausalLM'") as info:
        validate_checkpoint(path)
    assert "Qwen2ForCausalLM" in str(info.value) and "Qwen2_5OmniThinkerForConditionalGeneration" in str(info.value)


def test_an_architecture_not_yet_supported_is_refused_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _copy(tmp_path)
    _edit_config(path, architectures=["Qwen3OmniMoeThinkerForConditionalGeneration"])
    monkeypatch.setitem(families._NOT_YET, "Qwen3OmniMoeThinkerForConditionalGeneration", "its MoE text decoder")
    with pytest.raises(UnsupportedArchitectureError, match=r"\(its MoE text decoder\); supported: "):
        validate_checkpoint(path)


def test_qwen3_vl_folder_is_its_family(tmp_path: Path) -> None:
    ckpt = validate_checkpoint(write_tiny_checkpoint(tmp_path / "q3vl", "qwen3-vl"))
    assert ckpt.family is FAMILIES["Qwen3VLForConditionalGeneration"]
    assert (ckpt.family.name, ckpt.family.positions, ckpt.family.deepstack) == ("qwen3-vl", "vl3-mrope", True)
    tid = ckpt.tokenizer.convert_tokens_to_ids
    assert ckpt.tokens.placeholders == {
        "image": tid("<|IMAGE|>"),
        "video": tid("<|VIDEO|>"),
        "vision_start": tid("<|vision_bos|>"),
        "vision_end": tid("<|vision_eos|>"),
    }
    assert ckpt.preprocessor["patch_size"] == 16 == ckpt.config.vision_config.patch_size


def test_vocabulary_smaller_than_the_placeholder_ids_is_rejected(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    _edit_config(path, text_config__vocab_size=6)  # the audio placeholder is id 9
    with pytest.raises(CheckpointError, match="outside the model's vocabulary of 6"):
        validate_checkpoint(path)


def test_inconsistent_sizes_are_rejected(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    _edit_config(path, text_config__rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 1]})
    with pytest.raises(CheckpointError, match="mrope_section"):
        validate_checkpoint(path)


def test_a_bad_source_fails_before_any_data_is_written(tmp_path: Path) -> None:
    cfg = load_run_config(None, [f"model.source={tmp_path / 'missing'}", f"data.data_dir={tmp_path / 'data'}"])
    with pytest.raises(FileNotFoundError, match="missing"):
        prepare_data(cfg, tmp_path)
    assert not (tmp_path / "data").exists()


def test_never_sample_ids_are_the_tokenizers_specials_but_eos() -> None:
    tok = CKPT.tokenizer
    specials = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert set(CKPT.tokens.never_sample) == specials - {tok.convert_tokens_to_ids("<|im_end|>")}
    assert CKPT.tokens.eos_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert CKPT.tokens.pad_id == tok.convert_tokens_to_ids("<|endoftext|>")


def test_prompts_are_the_chat_template_with_each_placeholder_expanded(tmp_path: Path) -> None:
    from PIL import Image

    image = tmp_path / "red.png"
    Image.new("RGB", (56, 56), (220, 30, 30)).save(image)
    item = TaskItem(id="i", task="image", prompt="which colour? r g", media=(MediaRef("image", str(image)),))
    prompt = PromptBuilder(ModelConfig())(item)
    # Hand-written: Qwen's chat layout with a 56 × 56 image as 4 placeholder tokens (4 × 4 patches, merge 2).
    text = "<|im_start|>user\n<|vision_bos|>" + "<|IMAGE|>" * 4 + "<|vision_eos|>which colour? r g<|im_end|>\n"
    text += "<|im_start|>assistant\n"
    assert prompt.input_ids.tolist() == CKPT.tokenizer.encode(text, add_special_tokens=False)
    assert prompt.pixel_values is not None and prompt.pixel_values.shape == (16, 3 * 2 * 14 * 14)
    # The synthetic answers are single tokens of the tokenizer.
    for answer in ("r", "g", "l", "h", "u", "d", "7"):
        assert len(CKPT.tokenizer.encode(answer, add_special_tokens=False)) == 1


def test_relax_train_refuses_a_bad_model_folder_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from relax_services.cli import main

    path = _copy(tmp_path)
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    assert main(["train", f"model.source={path}", f"run.output_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert "model.source" in err and "'GPT2LMHeadModel'" in err and "supported:" in err
    assert not (tmp_path / "runs").exists()  # no run folder, hence no Ray and no service


_RANK_SCRIPT = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
from relax_services.models.tiny_omni import TinyOmniConfig, tiny_omni_checkpoint
print(tiny_omni_checkpoint(7, TinyOmniConfig()))
dist.destroy_process_group()
"""


def test_ranks_of_a_process_group_each_get_a_complete_default_folder(tmp_path: Path) -> None:
    """transformers' save_pretrained writes nothing on ranks other than 0 of an initialised process group; the
    default folder must come out complete whichever rank writes it first."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RELAX_CACHE_DIR": str(tmp_path / "cache")}
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, init, str(rank)], env=env, stdout=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    folders = {p.communicate(timeout=280)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    (folder,) = folders
    validate_checkpoint(Path(folder))
    assert (Path(folder) / "model.safetensors").is_file()
