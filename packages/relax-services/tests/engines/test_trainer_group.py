"""The Trainer as a group of Ray actors: it trains as one process does, and a rank that dies fails the group."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from relax_services.engines import LossInputs, TorchTrainEngine, TrainEngine
from relax_services.engines.fsdp.group import TrainerGroup, TrainerGroupConfig, TrainerGroupFailed
from relax_services.models import build_tiny_omni


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_fsdp_worker", Path(__file__).with_name("_fsdp_worker.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()
ATOL = 5e-5  # as in test_engines_fsdp.py: float summation order across ranks
TP_ATOL = 2e-4  # tensor parallelism, whole model: see test_tensor_parallel_ranks_train_like_one_process


def crash_on_rank_1(inputs: LossInputs) -> torch.Tensor:
    """The policy-gradient loss, except that rank 1's process dies in the middle of the update."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    return worker.pg_token_mean(inputs)[0]


def _pg_seq_mean(inputs: LossInputs) -> torch.Tensor:
    """The policy gradient as a mean over samples of each one's token mean (a run config's default aggregation)."""
    per_sample = (inputs.logprobs * inputs.fields["advantages"] * inputs.mask).sum(1) / inputs.mask.sum(1)  # [B]
    return -per_sample.mean()


def test_bad_group_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="world_size"):
        TrainerGroupConfig(world_size=0)
    with pytest.raises(ValueError, match="backend"):
        TrainerGroupConfig(backend="mpi")  # type: ignore[arg-type]


@pytest.mark.integration
def test_a_two_rank_group_trains_like_one_process_fails_whole_and_restarts_on_one_rank(
    ray_session: Any, tmp_path: Path
) -> None:
    reference = TorchTrainEngine(build_tiny_omni(0), worker.CONFIG)
    group = TrainerGroup(
        functools.partial(build_tiny_omni, 0),
        worker.CONFIG,
        group=TrainerGroupConfig(world_size=2, num_cpus_per_rank=0, step_timeout_s=240),
    )
    try:
        assert isinstance(group, TrainEngine)
        # A full state taken before the first update (a run's step-0 checkpoint) must not change that update.
        assert group.state_dict()["optimizer"]["state"] == {}
        metrics = group.step(worker.batch(0), worker.pg_token_mean)
        ref_metrics = reference.step(worker.batch(0), worker.pg_token_mean)
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5)
        assert _max_diff(group.policy_state(), reference.policy_state()) < ATOL
        assert group.version == 1
        full = group.state_dict()
        assert _max_diff(full["model"], reference.policy_state()) < ATOL
        group.save_checkpoint(tmp_path / "ckpt")

        with pytest.raises(TrainerGroupFailed, match="rank 1 failed in step"):
            group.step(worker.batch(1), crash_on_rank_1)
        assert not group.alive
        assert group.version == 1  # the broken update produced no version
        with pytest.raises(TrainerGroupFailed, match="failed earlier"):
            group.policy_state()  # nothing from the broken update can be published
    finally:
        group.shutdown()

    # The restarted group (here on one rank) resumes from the checkpoint and continues like one process.
    restarted = TrainerGroup(
        functools.partial(build_tiny_omni, 5),
        worker.CONFIG,
        group=TrainerGroupConfig(world_size=1, num_cpus_per_rank=0, step_timeout_s=240),
    )
    try:
        restarted.load_checkpoint(tmp_path / "ckpt")
        assert restarted.version == 1
        restarted.step(worker.batch(1), worker.pg_token_mean)
        reference.step(worker.batch(1), worker.pg_token_mean)
        resumed = restarted.policy_state()
        assert _max_diff(resumed, reference.policy_state()) < ATOL
        # The full state dict is a checkpoint too: from it, the same update gives the same weights.
        restarted.load_state_dict(full)
        assert restarted.version == 1
        restarted.step(worker.batch(1), worker.pg_token_mean)
        again = restarted.policy_state()
        assert all(torch.equal(again[k], resumed[k]) for k in resumed)
    finally:
        restarted.shutdown()


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.integration
def test_the_group_realises_the_plan_relax_plan_prints(ray_session: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from relax_services.cli import main
    from relax_services.config import load_run_config
    from relax_services.engines.fsdp import build_trainer_group

    overrides = ["trainer.world_size=2", "trainer.groups_per_step=4"]
    assert main(["plan", *overrides]) == 0
    printed = capsys.readouterr().out
    group = build_trainer_group(load_run_config(None, overrides), build_tiny_omni(0))
    try:
        # Rank 0 writes its text from the DeviceMesh torch built and the process groups it holds.
        assert group.plan_text + "\n" == printed
        assert "dp groups  [[0, 1]]; rank 0 in [0, 1]" in group.plan_text
    finally:
        group.shutdown()


@pytest.mark.integration
@pytest.mark.slow  # another group start (~15 s); test_engines_fsdp.py checks LoRA on 2 ranks in the default suite
def test_a_lora_run_config_builds_a_group_that_trains_and_saves_the_adapters(ray_session: Any, tmp_path: Path) -> None:
    """``model.lora`` on 2 ranks from a run config (rank 1 receives rank 0's checkpoint and adapters): one update as
    the single-process engine of the same config, merged weights published (or the adapters alone, gathered, for
    LoRA requests), the adapters alone in the full state, which the run's Hugging Face export reads."""
    from relax_services.config import load_run_config
    from relax_services.control.checkpoint import ENGINE_FILE
    from relax_services.engines.fsdp import build_trainer_group
    from relax_services.engines.torch import build_train_engine
    from relax_services.models.export import export_checkpoint

    overrides = ["trainer.world_size=2", "trainer.groups_per_step=4", "model.lora.rank=2"]
    cfg = load_run_config(None, overrides)
    assert cfg.algorithm.loss_agg_mode == "seq-mean-token-mean"  # micro-batches weighted by their samples
    reference = build_train_engine(cfg)
    group = build_trainer_group(cfg)
    try:
        metrics = group.step(worker.batch(0), _pg_seq_mean)
        ref_metrics = reference.step(worker.batch(0), _pg_seq_mean)
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5)
        assert _max_diff(group.policy_state(), reference.policy_state()) < ATOL  # merged, under the plain names
        published = group.adapter_state()  # what rollout.vllm.lora_requests publishes instead
        assert published.keys() == reference.adapter_state().keys()
        assert _max_diff(published, reference.adapter_state()) < ATOL
        state = group.state_dict()
    finally:
        group.shutdown()
    adapters = reference.state_dict()["model"]
    assert state["model"].keys() == adapters.keys()
    assert _max_diff(state["model"], adapters) < ATOL
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    torch.save(state, folder / ENGINE_FILE)
    assert (export_checkpoint(folder, cfg.model, tmp_path / "hf") / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.integration
@pytest.mark.slow  # a third group start (~40 s); test_engines_sp.py checks sp = 2 numerically in the default suite
def test_a_sequence_parallel_run_config_builds_the_group_relax_plan_prints(
    ray_session: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``trainer.sequence_parallel=2`` on 2 ranks: the group realises the printed plan (one sp group, dp = 1) and
    scores a batch as one process with the run's training settings does."""
    from relax_services.cli import main
    from relax_services.config import load_run_config
    from relax_services.engines.fsdp import build_trainer_group
    from relax_services.engines.torch import train_config

    overrides = ["trainer.world_size=2", "trainer.sequence_parallel=2", "trainer.groups_per_step=4"]
    assert main(["plan", *overrides]) == 0
    printed = capsys.readouterr().out
    cfg = load_run_config(None, overrides)
    group = build_trainer_group(cfg, build_tiny_omni(0))
    try:
        assert group.plan_text + "\n" == printed
        assert "cp groups  [[0, 1]]; rank 0 in [0, 1]" in group.plan_text
        logprobs, mask = group.compute_logprobs(worker.batch(100))
        want_logprobs, want_mask = TorchTrainEngine(build_tiny_omni(0), train_config(cfg)).compute_logprobs(
            worker.batch(100)
        )
        assert torch.equal(mask, want_mask)
        assert float((logprobs - want_logprobs).abs().max()) < ATOL
    finally:
        group.shutdown()


@pytest.mark.integration
def test_tensor_parallel_ranks_train_like_one_process(ray_session: Any) -> None:
    """tp = 2 on 2 ranks (dp = 1): every decoder block split over both ranks, three updates with gradient
    clipping and two minibatches each, against one process. Not bitwise: the split matmuls and the all-reduces
    add in another order (losses and gradient norms agree to ~1e-7 relative). The split decoder's weights stay
    within ATOL; the whole model within TP_ATOL, because AdamW's first step divides each gradient element by its
    own magnitude, so an element whose gradient is near zero (here in the vision patch embedding, which the
    gradient reaches through the split attention) turns float-order noise into a difference up to lr-sized
    (measured: 9.1e-5 after the first update, 9.1e-5 after the third: noise that does not grow)."""
    from relax_parallel import ParallelConfig

    reference = TorchTrainEngine(build_tiny_omni(0), worker.CONFIG)
    group = TrainerGroup(
        functools.partial(build_tiny_omni, 0),
        worker.CONFIG,
        group=TrainerGroupConfig(world_size=2, num_cpus_per_rank=0, step_timeout_s=240, parallel=ParallelConfig(tp=2)),
    )
    try:
        assert "tp groups  [[0, 1]]; rank 0 in [0, 1]" in group.plan_text
        assert "dp groups  [[0], [1]]; rank 0 in [0]" in group.plan_text
        initial = reference.policy_state()
        for update in range(3):
            metrics = group.step(worker.batch(update), worker.pg_token_mean)
            ref_metrics = reference.step(worker.batch(update), worker.pg_token_mean)
            assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5, abs=1e-6)
            assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
        expected = reference.policy_state()
        assert _max_diff(expected, initial) > 20 * ATOL  # the updates moved the weights far past the tolerance
        state = group.policy_state()
        assert _max_diff(state, expected) < TP_ATOL
        decoder = [k for k in expected if k.startswith("model.layers.")]
        assert decoder and _max_diff({k: state[k] for k in decoder}, {k: expected[k] for k in decoder}) < ATOL
    finally:
        group.shutdown()


@pytest.mark.integration
@pytest.mark.slow  # the default suite keeps the two-rank kill-and-restart test above; this one adds ~4 min
@pytest.mark.timeout(900)  # two groups start (each rank imports the model stack): ~4 min on 2 loaded cores
def test_a_tensor_parallel_group_killed_mid_update_restarts_from_its_checkpoints(
    ray_session: Any, tmp_path: Path
) -> None:
    """tp = 2 on 2 ranks: the kill_rank fault (SIGKILL inside the next update's first loss call, while the other
    rank waits in a tensor-parallel all-reduce) fails the whole group before that update has a version; a new
    group loads the run's full-state checkpoint (what the health manager's restart loads) or the sharded one,
    holds exactly the checkpoint's weights, and continues like one process."""
    from relax_parallel import ParallelConfig

    layout = TrainerGroupConfig(world_size=2, num_cpus_per_rank=0, step_timeout_s=240, parallel=ParallelConfig(tp=2))
    reference = TorchTrainEngine(build_tiny_omni(0), worker.CONFIG)
    group = TrainerGroup(functools.partial(build_tiny_omni, 0), worker.CONFIG, group=layout)
    try:
        group.step(worker.batch(0), worker.pg_token_mean)
        reference.step(worker.batch(0), worker.pg_token_mean)
        full = group.state_dict()
        group.save_checkpoint(tmp_path / "ckpt")
        saved = group.policy_state()
        group.arm_kill(1)
        with pytest.raises(TrainerGroupFailed, match=r"rank 1 failed in step \(update 2\)"):
            group.step(worker.batch(1), worker.pg_token_mean)
        assert not group.alive and group.version == 1
        with pytest.raises(TrainerGroupFailed, match="failed earlier"):
            group.policy_state()  # nothing of the broken update can be published
    finally:
        group.shutdown()

    restarted = TrainerGroup(functools.partial(build_tiny_omni, 5), worker.CONFIG, group=layout)
    try:
        restarted.load_state_dict(full)
        assert restarted.version == 1
        assert _equal(restarted.policy_state(), saved)
        restarted.step(worker.batch(1), worker.pg_token_mean)
        reference.step(worker.batch(1), worker.pg_token_mean)
        continued, expected = restarted.policy_state(), reference.policy_state()
        assert _max_diff(continued, expected) < TP_ATOL
        decoder = [k for k in expected if k.startswith("model.layers.")]
        assert _max_diff({k: continued[k] for k in decoder}, {k: expected[k] for k in decoder}) < ATOL

        restarted.load_checkpoint(tmp_path / "ckpt")  # the sharded checkpoint gives the same restart
        assert restarted.version == 1
        assert _equal(restarted.policy_state(), saved)
        restarted.step(worker.batch(1), worker.pg_token_mean)
        assert _equal(restarted.policy_state(), continued)
    finally:
        restarted.shutdown()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
