"""``rollout.env`` end to end: a colocated run whose Rollout drives multi-turn episodes of a user's environment.

The samples carry the environment's tokens masked out (``env_token_frac`` > 0 in the rollout and train records),
the environment's own reward reaches the Trainer through the Reward service, and an environment whose ``reset``
fails for some rows has those groups skipped and counted, while the run goes on to its last update.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_services.control.colocated import ColocatedController
from relax_services.reporting.metrics import read_metrics

STEPS = 3

ENV = '''
class Twice:
    """Asks twice; the second answer is scored (1 when it is the row's answer)."""

    def reset(self, row):
        if row["answer"] == "{fail}":
            raise RuntimeError("no such row")
        self.answer, self.turns, self.last = row["answer"], 0, ""
        return list(row["messages"])

    def step(self, assistant_message):
        self.turns += 1
        self.last = assistant_message["content"]
        return [{{"role": "user", "content": "again"}}], None, self.turns >= 2

    def reward(self):
        return 0.25 + 0.5 * float(self.last.strip() == self.answer)
'''


def _data(folder: Path, fail: str) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    rows[3]["answer"] = fail  # its environment's reset raises
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / "eval.jsonl").write_text(json.dumps(rows[0]) + "\n", encoding="utf-8")
    return folder


@pytest.mark.integration
def test_a_colocated_run_trains_on_episodes_of_a_user_environment(small_config, tmp_path: Path) -> None:
    fail = "99"
    data = _data(tmp_path, fail)
    env = tmp_path / "env.py"
    env.write_text(ENV.format(fail=fail), encoding="utf-8")
    cfg = small_config(
        "run.mode=colocated",
        f"trainer.total_steps={STEPS}",
        f"rollout.env={env}:Twice",
        "rollout.max_turns=3",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.eval_files={data / 'eval.jsonl'}",
        "trainer.warmup_format_steps=0",
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = ColocatedController(cfg, run_dir).run()
    assert result.steps == STEPS

    metrics = run_dir / "metrics.jsonl"
    rollouts = list(read_metrics(metrics, "rollout"))
    assert rollouts and max(r["turns_mean"] for r in rollouts) >= 1  # a call may hold the failing row alone
    assert sum(r["env_token_frac"] for r in rollouts) > 0  # the environment's "again" turns are in the samples
    trains = list(read_metrics(metrics, "train"))
    assert len(trains) == STEPS and all(0 <= t["env_token_frac"] < 1 for t in trains), trains
    assert sum(t["env_token_frac"] for t in trains) > 0
    # Every reward is the environment's (0.25 or 0.75), none is reward.fn's exact match (0 or 1).
    assert all(t["reward"] >= 0.25 for t in trains)
    rewards = list(read_metrics(metrics, "reward"))
    assert sum(r["env_scored"] for r in rewards) == sum(r["scored"] for r in rewards) > 0
    # The row whose reset fails: skipped with the environment's error after its retries, never trained on.
    skipped = [r for r in read_metrics(metrics, "skipped") if "environment" in r["reason"]]
    assert skipped and all("no such row" in r["reason"] for r in skipped)


EXAMPLES = Path(__file__).resolve().parents[1] / "packages" / "relax-services" / "examples"


def _run_example(small_config, tmp_path: Path, example: str, env: str, *overrides: str) -> None:
    """A colocated run of ``STEPS`` updates on ``example``'s environment and 16 of its rows (its ``prepare.py``):
    some episodes went past their first turn, every update trained with environment tokens masked (the environment's
    only turn is its media's) and the rewards are the environment's 0 or 1."""
    from relax_core import import_file

    folder = EXAMPLES / example
    prepare = import_file(folder / "prepare.py", f"relax_test_{example}_prepare", f"examples/{example}/prepare.py")
    for name, n, seed in (("train", 16, 0), ("eval", 2, 1)):
        rows = "".join(json.dumps(r) + "\n" for r in prepare.rows(n, seed))
        (tmp_path / f"{name}.jsonl").write_text(rows, encoding="utf-8")
    cfg = small_config(
        "run.mode=colocated",
        f"trainer.total_steps={STEPS}",
        f"rollout.env={folder / f'{example}_env.py'}:{env}",
        "rollout.max_turns=2",
        "rollout.max_new_tokens=2",
        "algorithm.kl_coef=0.05",  # the Reference scores the samples too
        f"data.train_files={tmp_path / 'train.jsonl'}",
        f"data.eval_files={tmp_path / 'eval.jsonl'}",
        *overrides,
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert ColocatedController(cfg, run_dir).run().steps == STEPS
    metrics = run_dir / "metrics.jsonl"
    rollouts = list(read_metrics(metrics, "rollout"))
    assert max(r["turns_mean"] for r in rollouts) > 1  # some episodes got the media and answered
    trains = list(read_metrics(metrics, "train"))
    assert len(trains) == STEPS and all(0 <= t["env_token_frac"] < 1 for t in trains), trains
    # The environment's only turn is its media's: an update with environment tokens trained on samples with them.
    assert any(t["env_token_frac"] > 0 for t in trains)
    assert all(0.0 <= t["reward"] <= 1.0 for t in trains)


@pytest.mark.integration
def test_a_colocated_run_trains_on_episodes_whose_environment_returns_an_image(small_config, tmp_path: Path) -> None:
    """The zoom example's environment (an image crop in turn 2): the Rollout writes each episode's sample with the
    crop in its prompt's media and its placeholders in the response, and the Trainer and the Reference score them
    (a placeholder count that did not match the media would raise in their forward) to the last update."""
    _run_example(small_config, tmp_path, "zoom", "Zoom")


@pytest.mark.slow
@pytest.mark.integration
def test_a_colocated_run_trains_on_episodes_whose_environment_returns_audio(small_config, tmp_path: Path) -> None:
    """The listen example's environment (a 0.5 s audio segment in turn 2, 12 audio tokens): as the zoom test, with
    the audio encoder in the Rollout's, the Trainer's and the Reference's forwards. Slow: the zoom test covers the
    same path with an image, and tests/agents/test_media.py scores an audio turn against a plain forward."""
    # A first turn that names no segment ends the episode: the warm-up teaches the form (a digit and the eos).
    _run_example(small_config, tmp_path, "listen", "Listen", "trainer.warmup_format_steps=30")
