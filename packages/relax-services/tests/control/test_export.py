"""Hugging Face export: a run checkpoint's policy (and critic) written with save_pretrained loads back with plain
transformers and gives the trained weights' logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoTokenizer

from relax_core import dump_config
from relax_services.cli import main
from relax_services.config import ModelConfig, load_run_config
from relax_services.control.checkpoint import CONTROLLER_FILE, ENGINE_FILE, PROMPTS_FILE, SAMPLES_FILE
from relax_services.engines import LossInputs, TorchTrainConfig, TorchTrainEngine, TorchValueEngine, TrainSample
from relax_services.models import DEFAULT_SOURCE, build_tiny_omni, build_value_model, open_checkpoint
from relax_services.models.export import export_checkpoint
from relax_services.models.synthetic import synthetic_prompt

CKPT = open_checkpoint(DEFAULT_SOURCE)


def _nll(inputs: LossInputs) -> torch.Tensor:
    return -(inputs.logprobs * inputs.mask).sum() / inputs.mask.sum()


def _trained_state(tmp_path: Path, with_critic: bool) -> tuple[Path, TorchTrainEngine, TorchValueEngine | None]:
    """A checkpoint folder holding the engine state of one update away from the initial weights."""
    cfg = TorchTrainConfig(lr=1e-2, suppressed_ids=CKPT.tokens.never_sample)
    batch = [TrainSample(synthetic_prompt("image", [20, 21], torch.Generator().manual_seed(1)), torch.tensor([30, 2]))]
    engine = TorchTrainEngine(build_tiny_omni(0), cfg)
    engine.step(batch, _nll)
    state = engine.state_dict()
    critic = None
    if with_critic:
        critic = TorchValueEngine(build_value_model(build_tiny_omni(0)), cfg)
        with torch.no_grad():
            critic.model.value_head.weight.add_(0.5)
        state["critic"] = critic.state_dict()
    folder = tmp_path / "checkpoints" / "step_00000001"
    folder.mkdir(parents=True)
    torch.save(state, folder / ENGINE_FILE)
    return folder, engine, critic


def _logits(model: torch.nn.Module) -> torch.Tensor:
    prompt = synthetic_prompt("video", [13, 14], torch.Generator().manual_seed(2))
    ids = prompt.input_ids[None]
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), **prompt.media()).logits


def test_export_round_trips_the_trained_policy_and_critic(tmp_path: Path) -> None:
    folder, engine, critic = _trained_state(tmp_path, with_critic=True)
    out = export_checkpoint(folder, ModelConfig(), tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    loaded = AutoModelForImageTextToText.from_pretrained(out, local_files_only=True)
    torch.testing.assert_close(_logits(loaded), _logits(engine.model.eval()), atol=0, rtol=0)
    assert not torch.equal(_logits(loaded), _logits(build_tiny_omni(0)))  # the update is in the export
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tokenizer.chat_template == CKPT.tokenizer.chat_template
    assert critic is not None
    head = load_file(out / "critic" / "value_head.safetensors")
    torch.testing.assert_close(head["weight"], critic.model.value_head.weight.detach(), atol=0, rtol=0)
    backbone = AutoModelForImageTextToText.from_pretrained(out / "critic", local_files_only=True)
    torch.testing.assert_close(_logits(backbone), _logits(critic.model.thinker.eval()), atol=0, rtol=0)


def test_relax_export_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    folder, engine, _ = _trained_state(run, with_critic=False)
    for name in (CONTROLLER_FILE, PROMPTS_FILE, SAMPLES_FILE):  # a complete checkpoint has them; export reads none
        (folder / name).write_bytes(b"")
    (run / "config.yaml").write_text(dump_config(load_run_config(None)))
    assert main(["export", str(run), "--step", "1", str(tmp_path / "out")]) == 0
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "out", local_files_only=True)
    torch.testing.assert_close(_logits(loaded), _logits(engine.model.eval()), atol=0, rtol=0)
    assert main(["export", str(run), "--step", "7", str(tmp_path / "out2")]) == 2
    assert "no complete checkpoint of step 7" in capsys.readouterr().err
