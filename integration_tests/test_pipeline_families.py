"""Tiny random checkpoint folders of the families train through the async pipeline: the text causal LMs (Qwen2 /
Qwen3 / Llama) and Qwen3-VL (images, videos in its timestamped per-frame layout, and text; its DeepStack vision
features in the trainer's decoder)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from relax_services.control.checkpoint import ENGINE_FILE, CheckpointManager
from relax_services.models.tiny_families import write_tiny_checkpoint
from relax_services.reporting.metrics import read_metrics


def _four_updates_at_tau2(cfg, run_pipeline) -> Path:
    """Runs ``cfg``; checks 4 finite updates whose tokens were never staler than τ = 2; the latest checkpoint."""
    result = run_pipeline(cfg)
    assert result.steps == 4
    rows = list(read_metrics(result.run_dir / "metrics.jsonl", "train"))
    hist: dict[int, int] = {}
    for row in rows:
        for k, v in row["token_staleness_hist"].items():
            hist[int(k)] = hist.get(int(k), 0) + v
    assert sum(hist.values()) == 4 * cfg.samples_per_step and max(hist) <= 2, hist  # never staler than τ
    assert len(rows) == 4 and all(torch.isfinite(torch.tensor(row["loss"])) for row in rows)
    latest = CheckpointManager(result.run_dir / "checkpoints").latest()
    assert latest is not None
    return latest


def _trained_tasks(run_dir: Path) -> set[str]:
    """The tasks whose samples the run's updates trained on (its ``train`` records)."""
    return {task for row in read_metrics(run_dir / "metrics.jsonl", "train") for task in row["reward_by_task"]}


@pytest.mark.integration
@pytest.mark.parametrize(
    "family",
    [
        "qwen2",
        # Slow: the same τ = 2 pipeline and HF export path as qwen2's and llama's (nothing in either is per family);
        # Qwen3 itself trains through the pipeline in the default suite in
        # test_tau0_pipeline_equals_sequential_trainer_for_a_family[qwen3-[text]].
        pytest.param("qwen3", marks=pytest.mark.slow),
        "llama",
    ],
)
def test_text_family_trains_at_tau2(family: str, small_config, run_pipeline, tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path / family, family, seed=0)
    cfg = small_config(f"model.source={folder}", "data.tasks=[text]", "staleness.tau=2", "trainer.total_steps=4")
    latest = _four_updates_at_tau2(cfg, run_pipeline)
    # The updates moved the weights away from the folder's.
    final = torch.load(latest / ENGINE_FILE, weights_only=False)["model"]
    initial = load_file(folder / "model.safetensors")
    assert any(not torch.equal(final[k], initial[k]) for k in initial)
    # The checkpoint's Hugging Face copy holds exactly the trained weights and the folder's tokenizer.
    exported = AutoModelForCausalLM.from_pretrained(latest / "hf", local_files_only=True).state_dict()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    assert AutoTokenizer.from_pretrained(latest / "hf", local_files_only=True).chat_template


@pytest.mark.integration
def test_qwen3_vl_trains_images_and_videos_at_tau2(small_config, run_pipeline, tmp_path: Path) -> None:
    # One run of both vision tasks (and text): images, and the synthetic video task's clips in Qwen3-VL's layout
    # (a <t seconds> text and its own block per temporal step), reach rollout and trainer at τ = 2; that the video
    # rows alone reach the vision tower exactly is checked bit for bit by the τ = 0 case below.
    folder = write_tiny_checkpoint(tmp_path / "qwen3-vl", "qwen3-vl", seed=0)
    cfg = small_config(
        f"model.source={folder}", "data.tasks=[image, video, text]", "staleness.tau=2", "trainer.total_steps=4"
    )
    latest = _four_updates_at_tau2(cfg, run_pipeline)
    assert _trained_tasks(latest.parents[1]) == {"image", "video", "text"}
    final = torch.load(latest / ENGINE_FILE, weights_only=False)["model"]
    initial = load_file(folder / "model.safetensors")
    # The updates moved the vision tower's weights too (DeepStack mergers included: their features reach the loss).
    moved = {k for k in initial if not torch.equal(final[k], initial[k])}
    assert any(k.startswith("model.visual.blocks") for k in moved), sorted(moved)[:5]
    assert any(k.startswith("model.visual.deepstack_merger_list") for k in moved), sorted(moved)[:5]
    assert any(k.startswith("model.language_model") for k in moved)
    exported = AutoModelForImageTextToText.from_pretrained(latest / "hf", local_files_only=True)
    assert type(exported).__name__ == "Qwen3VLForConditionalGeneration"
    assert all(torch.equal(exported.state_dict()[k], final[k]) for k in final)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("family", "tasks"),
    [
        ("qwen3", "[text]"),
        ("qwen2.5-vl", "[image, text]"),
        ("qwen3-vl", "[image, video, text]"),
    ],
)
def test_tau0_pipeline_equals_sequential_trainer_for_a_family(
    family: str, tasks: str, small_config, run_pipeline, sequential_weights, tmp_path: Path
) -> None:
    folder = write_tiny_checkpoint(tmp_path / family, family, seed=0)
    steps = 2
    cfg = small_config(
        f"model.source={folder}",
        "staleness.tau=0",
        f"trainer.total_steps={steps}",
        "data.adaptive_weights=false",
        f"data.tasks={tasks}",
        "algorithm.kl_coef=0.0",
    )
    result = run_pipeline(cfg)
    assert result.staleness_hist == {0: steps * cfg.samples_per_step}
    assert _trained_tasks(result.run_dir) == set(tasks.strip("[]").split(", "))
    latest = CheckpointManager(result.run_dir / "checkpoints").latest()
    assert latest is not None
    pipeline_weights = CheckpointManager.load_engine(latest)["model"]
    expected = sequential_weights(cfg, tmp_path / "sequential", steps)
    initial = load_file(folder / "model.safetensors")
    assert any(not torch.equal(initial[k], expected[k]) for k in initial), "the reference loop did not train"
    mismatched = [k for k in expected if not torch.equal(pipeline_weights[k], expected[k])]
    assert not mismatched, f"{len(mismatched)} tensors differ, e.g. {mismatched[:3]}"
