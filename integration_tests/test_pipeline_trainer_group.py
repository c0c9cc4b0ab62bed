"""The Trainer as a group of ranks (``trainer.world_size=2``, FSDP2 over gloo) inside a whole run.

τ = 0: the run equals the plain sequential loop of ``conftest.py`` (one process, the torch engine) to a float
tolerance; killing one rank mid-update fails the group, the run restarts it from the last checkpoint, nothing
of the broken update is published and the ledger stays exact.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from relax_services.control.checkpoint import CheckpointManager
from relax_services.models import load_model
from relax_services.models.export import HF_FOLDER
from relax_services.models.lora import ADAPTER_FOLDER, apply_lora, load_adapter_state, merged_state
from relax_services.models.policy import build_policy
from relax_services.reporting.metrics import read_metrics

# Two ranks add the same per-sample gradient terms in a different order than one process (each rank sums its
# share, then the shares are summed; the grad norm adds per-shard squares): ~1e-7 relative on a gradient. A few
# AdamW steps at lr 1e-3 keep the weights within ~1e-6 of each other (the engine-level test sees ~5e-6 after
# six steps at lr 1e-2); the updates themselves move the weights by ~1e-3, far above the tolerance.
ATOL = 5e-5

TAU0 = [
    "staleness.tau=0",
    "trainer.world_size=2",
    "data.adaptive_weights=false",
    "data.tasks=[image, text]",
    "algorithm.kl_coef=0.0",
]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _final_state(run_dir: Path) -> dict:
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    assert latest is not None
    return CheckpointManager.load_engine(latest)


def _check_against_sequential(cfg, state: dict, sequential_weights, tmp_path: Path, steps: int) -> None:
    torch.set_num_threads(2)  # the reference loop's engine pins its own intra-op thread count
    expected = sequential_weights(cfg, tmp_path / "sequential", steps)
    initial = build_policy(cfg.model).state_dict()
    moved = max(float((initial[k] - expected[k]).abs().max()) for k in expected)
    assert moved > 20 * ATOL, "the reference loop did not train past the tolerance"
    # Same samples: a sampled token that differed would move the weights far more than the tolerance.
    assert _max_diff(state["model"], expected) < ATOL


@pytest.mark.integration
@pytest.mark.timeout(1800)  # eight actors (two of them trainer ranks) import the model stack on 2 loaded cores
def test_tau0_pipeline_with_two_trainer_ranks_equals_sequential_trainer(
    small_config, run_pipeline, sequential_weights, tmp_path: Path
) -> None:
    steps = 3
    cfg = small_config(*TAU0, f"trainer.total_steps={steps}")
    assert cfg.trainer.engine == "fsdp" and cfg.trainer.world_size == 2
    result = run_pipeline(cfg)
    assert result.steps == steps
    assert result.staleness_hist == {0: steps * cfg.samples_per_step}  # strictly on-policy
    state = _final_state(result.run_dir)
    assert state["version"] == steps
    _check_against_sequential(cfg, state, sequential_weights, tmp_path, steps)
    assert result.ledger["lost"] == 0 and result.ledger["duplicated"] == 0
    assert result.ledger["consumed"] == steps * cfg.trainer.groups_per_step


@pytest.mark.slow  # another whole run with two ranks; tests/engines/test_engines_fsdp.py checks LoRA on 2 ranks
@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_tau0_pipeline_with_lora_on_two_trainer_ranks_equals_sequential_trainer(
    small_config, run_pipeline, sequential_weights, tmp_path: Path
) -> None:
    """``model.lora`` on the two ranks: the run's checkpoint (the group's full state) holds the adapters alone, and
    merged into the frozen weights they are the sequential trainer's (one process, adapters too); its Hugging Face
    export is that merged model plus the adapter folder."""
    steps = 3
    lora = "model.lora={rank: 4, alpha: 8, target_modules: [q_proj, v_proj, o_proj]}"
    cfg = small_config(*TAU0, lora, f"trainer.total_steps={steps}")
    assert cfg.trainer.engine == "fsdp" and cfg.model.lora is not None
    result = run_pipeline(cfg)
    assert result.steps == steps
    assert result.staleness_hist == {0: steps * cfg.samples_per_step}
    state = _final_state(result.run_dir)
    assert state["version"] == steps
    assert state["model"] and all(".lora_A." in k or ".lora_B." in k for k in state["model"])
    adapted = apply_lora(build_policy(cfg.model), cfg.model.lora)
    load_adapter_state(adapted, state["model"])
    merged = merged_state(adapted)
    _check_against_sequential(cfg, {"model": merged}, sequential_weights, tmp_path, steps)
    latest = CheckpointManager(result.run_dir / "checkpoints").latest()
    assert latest is not None
    exported = load_model(latest / HF_FOLDER).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in merged.items())
    assert (latest / HF_FOLDER / ADAPTER_FOLDER / "adapter_model.safetensors").is_file()


@pytest.mark.slow  # a second whole run with two ranks; the dp = 2 run above stays in the default suite
@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_tau0_pipeline_with_sequence_parallel_ranks_equals_sequential_trainer(
    small_config, run_pipeline, sequential_weights, tmp_path: Path
) -> None:
    """``trainer.sequence_parallel=2`` on the two ranks (dp = 1, every sequence split, media encoding shared): the
    run the sequential loop trains, and the plan it recorded is the sp mesh."""
    steps = 3
    cfg = small_config(*TAU0, "trainer.sequence_parallel=2", f"trainer.total_steps={steps}")
    result = run_pipeline(cfg)
    assert result.steps == steps
    assert result.staleness_hist == {0: steps * cfg.samples_per_step}
    state = _final_state(result.run_dir)
    assert state["version"] == steps
    _check_against_sequential(cfg, state, sequential_weights, tmp_path, steps)
    plans = [m["text"] for m in read_metrics(result.run_dir / "metrics.jsonl", "plan")]
    assert plans and "cp groups  [[0, 1]]; rank 0 in [0, 1]" in plans[-1]


@pytest.mark.slow  # a whole global restart (every service and both ranks start again): minutes on 2 cores
@pytest.mark.integration
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("layout", [[], ["trainer.tensor_parallel=2"]], ids=["dp2", "tp2"])
def test_killed_trainer_rank_restarts_the_group_from_the_checkpoint(
    small_config, run_pipeline, sequential_weights, tmp_path: Path, layout: list[str]
) -> None:
    """Two ranks data-parallel (``dp2``) or splitting every decoder block (``tp2``: the killed rank dies while the
    other waits in a tensor-parallel all-reduce)."""
    steps = 6
    cfg = small_config(
        *TAU0,
        *layout,
        f"trainer.total_steps={steps}",
        "trainer.checkpoint_every=2",
        "faults=[{service: trainer, kind: kill_rank, at_step: 3}]",
    )
    result = run_pipeline(cfg)
    assert result.steps == steps
    events = list(read_metrics(result.run_dir / "metrics.jsonl", "health"))
    kinds = [(e["event"], e["service"]) for e in events]
    assert ("injected", "trainer") in kinds and ("global_restart", "run") in kinds, kinds
    assert ("recovered", "run") in kinds, kinds
    detected = next(e for e in events if e["event"] == "detected" and e["service"] == "trainer")
    assert "TrainerGroupFailed" in detected["reason"] and "rank 1 failed in step" in detected["reason"], detected
    match = re.search(r"update (\d+)", detected["reason"])
    assert match is not None, detected
    broken = int(match.group(1))
    assert broken > 3  # armed once the run had reached step 3: the rank died in a later update

    # Nothing of the broken update was published: the failed group recorded updates up to the one before it
    # only; the restarted group went back to a checkpoint and trained every later update once more.
    restart = next(e for e in events if e["event"] == "global_restart")
    train = list(read_metrics(result.run_dir / "metrics.jsonl", "train"))
    before = sorted(r["step"] for r in train if r["time"] < detected["time"])
    after = sorted(r["step"] for r in train if r["time"] > restart["time"])
    assert before == list(range(1, broken)), before
    assert after and after == list(range(after[0], steps + 1)) and after[0] <= broken, after

    ledger = result.ledger
    assert ledger["lost"] == 0 and ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    assert ledger["consumed"] == steps * cfg.trainer.groups_per_step, ledger
    state = _final_state(result.run_dir)
    assert state["version"] == steps
    _check_against_sequential(cfg, state, sequential_weights, tmp_path, steps)
