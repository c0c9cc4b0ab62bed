"""Every advantage estimator and policy loss of the algorithm table runs end to end: a 3-update colocated run on
the tiny default (``run.mode=colocated``, the same services as threads of one process), finite losses; and the
adaptive KL controller's coefficient moves toward its target and is in the checkpoint a resume reads."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from relax_core import POLICY_LOSSES, algorithm_spec, estimator_names
from relax_services.control.checkpoint import CheckpointManager
from relax_services.control.colocated import ColocatedController
from relax_services.reporting.metrics import read_metrics

STEPS = 3
# Estimators that need no critic (remax included: the Rollout scores each prompt's greedy response as its baseline).
GROUP_ESTIMATORS = [name for name in estimator_names() if not algorithm_spec(name).needs_critic]


def _train_records(cfg: object, tmp_path: Path) -> tuple[list[dict[str, object]], Path]:
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    result = ColocatedController(cfg, run_dir).run()  # type: ignore[arg-type]
    assert result.steps == STEPS
    return list(read_metrics(run_dir / "metrics.jsonl", "train")), run_dir


def _check_finite(records: list[dict[str, object]]) -> None:
    assert len(records) == STEPS
    for r in records:
        assert math.isfinite(float(r["loss"])), r  # type: ignore[arg-type]


# Those the older pipeline tests already run end to end are in the slow set; the rest run by default (~6 s each).
COVERED = {"grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo", "gspo", "cispo", "sapo"}


def _params(names: list[str]) -> list[object]:
    return [pytest.param(n, marks=pytest.mark.slow) if n in COVERED else n for n in names]


@pytest.mark.integration
@pytest.mark.parametrize("estimator", _params(GROUP_ESTIMATORS))
def test_every_estimator_trains(estimator: str, small_config, tmp_path: Path) -> None:
    cfg = small_config(
        "run.mode=colocated",
        "staleness.tau=0",
        f"trainer.total_steps={STEPS}",
        f"algorithm.advantage_estimator={estimator}",
    )
    _check_finite(_train_records(cfg, tmp_path)[0])


@pytest.mark.integration
@pytest.mark.parametrize("policy_loss", _params(sorted(POLICY_LOSSES)))
def test_every_policy_loss_trains(policy_loss: str, small_config, tmp_path: Path) -> None:
    cfg = small_config(
        "run.mode=colocated", "staleness.tau=0", f"trainer.total_steps={STEPS}", f"algorithm.policy_loss={policy_loss}"
    )
    _check_finite(_train_records(cfg, tmp_path)[0])


@pytest.mark.integration
def test_adaptive_kl_coefficient_moves_toward_its_target_and_is_checkpointed(small_config, tmp_path: Path) -> None:
    # The policy starts as the reference: the measured KL is ~0, far below the target, so β must shrink each update
    # by the clipped factor 1 − 0.2 · samples / horizon.
    cfg = small_config(
        "run.mode=colocated",
        "staleness.tau=0",
        f"trainer.total_steps={STEPS}",
        "algorithm.kl_coef=0.5",
        "algorithm.kl_estimator=k3",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.target_kl=10.0",
        "algorithm.kl_ctrl.horizon=80",
    )
    records, run_dir = _train_records(cfg, tmp_path)
    _check_finite(records)
    betas = [float(r["kl_coef"]) for r in records]  # type: ignore[arg-type]
    beta = 0.5
    for r, logged in zip(records, betas, strict=True):
        assert logged == pytest.approx(beta, rel=1e-12)
        error = min(max(float(r["kl"]) / 10.0 - 1.0, -0.2), 0.2)  # type: ignore[arg-type]
        beta *= 1.0 + error * int(r["samples"]) / 80  # type: ignore[call-overload]
    assert betas[0] > betas[1] > betas[2]
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    assert latest is not None
    assert CheckpointManager.load_engine(latest)["kl_ctrl"] == {"value": pytest.approx(beta, rel=1e-12)}
    # Resumed for two more updates, the run continues from the checkpointed β, not from kl_coef.
    longer = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"total_steps": STEPS + 2})})
    ColocatedController(longer, run_dir, resume=True, resume_changes={"trainer.total_steps": (STEPS, STEPS + 2)}).run()
    resumed = list(read_metrics(run_dir / "metrics.jsonl", "train"))[STEPS:]
    assert [int(r["step"]) for r in resumed] == [STEPS + 1, STEPS + 2]  # type: ignore[call-overload]
    assert float(resumed[0]["kl_coef"]) == pytest.approx(beta, rel=1e-12)  # type: ignore[arg-type]
