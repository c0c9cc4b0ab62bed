"""τ = 0 reproduces a synchronous trainer exactly: same samples, same updates, same weights.

The reference is a plain sequential loop written here from relax-core functions (rewards, GRPO advantages,
the policy loss) and the engines: generate a step's groups with the current weights, score, compute advantages,
update, repeat. The asynchronous pipeline (separate Rollout, Reward and Trainer processes joined by the queue)
must end with bit-identical weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_services.control.checkpoint import CheckpointManager
from relax_services.models.policy import build_policy
from relax_services.reporting.metrics import read_metrics

STEPS = 3


# Slow: a whole pipeline start for what the default suite checks elsewhere. The broadcast case below runs this config
# through the same Ray pipeline with every assertion made here; the object store's weight sync (this case's) is held
# to the same bitwise equality by test_pipeline_families.py's τ = 0 cases (three families) and, for this model and
# config, to a float tolerance by test_pipeline_trainer_group.py (two trainer ranks); test_colocated.py holds this
# model and config bitwise in one process.
@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1800)  # seven actors import the model stack: minutes on a loaded 2-core machine
def test_tau0_pipeline_equals_sequential_trainer(
    small_config, run_pipeline, sequential_weights, tmp_path: Path
) -> None:
    cfg = small_config(
        "staleness.tau=0",
        f"trainer.total_steps={STEPS}",
        "data.adaptive_weights=false",
        "data.tasks=[image, text]",
        "algorithm.kl_coef=0.0",
    )
    assert cfg.algorithm.decoupled and not cfg.algorithm.uses_reference
    result = run_pipeline(cfg)
    assert result.steps == STEPS
    assert result.staleness_hist == {0: STEPS * cfg.samples_per_step}  # strictly on-policy
    latest = CheckpointManager(result.run_dir / "checkpoints").latest()
    assert latest is not None
    state = CheckpointManager.load_engine(latest)
    assert state["version"] == STEPS
    pipeline_weights = state["model"]

    # The reference loop runs in this process, started here with two intra-op threads (as from a shell with
    # OMP_NUM_THREADS=2) while every service runs with one: the engines fix the count they compute with.
    torch.set_num_threads(2)
    expected = sequential_weights(cfg, tmp_path / "sequential", STEPS)
    initial = build_policy(cfg.model).state_dict()
    assert any(not torch.equal(initial[k], expected[k]) for k in expected), "the reference loop did not train"
    mismatched = [k for k in expected if not torch.equal(pipeline_weights[k], expected[k])]
    assert not mismatched, f"{len(mismatched)} tensors differ, e.g. {mismatched[:3]}"


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_tau0_pipeline_with_broadcast_weight_sync_equals_sequential_trainer(
    small_config, run_pipeline, sequential_weights, tmp_path: Path
) -> None:
    """``trainer.weight_sync=broadcast``: the rollout worker takes the Trainer's versions from a gloo broadcast
    once it is in the group (a version before that comes from the object store) and the run stays bit-identical."""
    cfg = small_config(
        "staleness.tau=0",
        f"trainer.total_steps={STEPS}",
        "data.adaptive_weights=false",
        "data.tasks=[image, text]",
        "algorithm.kl_coef=0.0",
        "trainer.weight_sync=broadcast",
        "trainer.sync_bucket_mib=0.25",  # several buckets for the tiny model (about 1.7 MB)
    )
    assert cfg.algorithm.decoupled and not cfg.algorithm.uses_reference
    result = run_pipeline(cfg)
    assert result.steps == STEPS
    assert result.staleness_hist == {0: STEPS * cfg.samples_per_step}  # strictly on-policy
    paths: dict[str, str] = {}
    for record in read_metrics(result.run_dir / "metrics.jsonl", "rollout"):
        paths.update(record["weight_paths"])
    # The worker starts on version 0 (its own copy of the initial weights); versions 1 .. STEPS - 1 generate the
    # later batches, and every one from the worker's joining the group on came by broadcast.
    assert set(paths) >= {str(v) for v in range(1, STEPS)}, paths
    assert "broadcast" in paths.values(), paths
    joined = min(int(v) for v, path in paths.items() if path == "broadcast")
    assert all(paths[str(v)] == "broadcast" for v in range(joined, STEPS)), paths
    plans = list(read_metrics(result.run_dir / "metrics.jsonl", "plan"))
    assert len(plans) == 1 and "engine torch: one process" in plans[0]["text"]  # the plan record of the run
    latest = CheckpointManager(result.run_dir / "checkpoints").latest()
    assert latest is not None
    state = CheckpointManager.load_engine(latest)
    assert state["version"] == STEPS
    pipeline_weights = state["model"]
    # As in the reference loop of the case above: two intra-op threads here, one in every service.
    torch.set_num_threads(2)
    expected = sequential_weights(cfg, tmp_path / "sequential", STEPS)
    initial = build_policy(cfg.model).state_dict()
    assert any(not torch.equal(initial[k], expected[k]) for k in expected), "the reference loop did not train"
    mismatched = [k for k in expected if not torch.equal(pipeline_weights[k], expected[k])]
    assert not mismatched, f"{len(mismatched)} tensors differ, e.g. {mismatched[:3]}"
