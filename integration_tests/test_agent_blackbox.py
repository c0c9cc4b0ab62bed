"""``rollout.agent`` end to end: a colocated run whose Rollout serves a black-box agent's chat-completions calls.

The agent, written against the ``openai`` client only, asks twice (its second call re-sends the conversation with a
user's "again"); the samples carry the user's turn masked out (``env_token_frac`` > 0 in the rollout and train
records), the agent's own reward reaches the Trainer through the Reward service, and an agent that raises before
its first call for some rows has those groups skipped and counted, while the run goes on to its last update.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_services.control.colocated import ColocatedController
from relax_services.reporting.metrics import read_metrics

STEPS = 3

AGENT = """
async def run(task, client):
    if task["answer"] == "{fail}":
        raise RuntimeError("no such row")
    messages = list(task["messages"])
    last = ""
    for turn in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        last = reply.choices[0].message.content or ""
        messages += [reply.choices[0].message, {{"role": "user", "content": "again"}}]
    return 0.25 + 0.5 * float(last.strip() == task["answer"])
"""


def _data(folder: Path, fail: str) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    rows[3]["answer"] = fail  # its agent raises before any call
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / "eval.jsonl").write_text(json.dumps(rows[0]) + "\n", encoding="utf-8")
    return folder


@pytest.mark.integration
def test_a_colocated_run_trains_on_a_black_box_agents_episodes(small_config, tmp_path: Path) -> None:
    fail = "99"
    data = _data(tmp_path, fail)
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT.format(fail=fail), encoding="utf-8")
    cfg = small_config(
        "run.mode=colocated",
        f"trainer.total_steps={STEPS}",
        f"rollout.agent={agent}:run",
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
    assert rollouts and max(r["turns_mean"] for r in rollouts) > 1  # the second call extended the first
    assert sum(r["env_token_frac"] for r in rollouts) > 0  # the user's "again" turn is in the samples
    assert sum(r["prefix_breaks"] for r in rollouts) == 0
    trains = list(read_metrics(metrics, "train"))
    assert len(trains) == STEPS and all(0 <= t["env_token_frac"] < 1 for t in trains), trains
    assert sum(t["env_token_frac"] for t in trains) > 0
    # Every reward is the agent's (0.25 or 0.75), none is reward.fn's exact match (0 or 1).
    assert all(t["reward"] >= 0.25 for t in trains)
    rewards = list(read_metrics(metrics, "reward"))
    assert sum(r["env_scored"] for r in rewards) == sum(r["scored"] for r in rewards) > 0
    # The row whose agent raises before any call: no tokens, so requeued, then skipped with the agent's error.
    skipped = [r for r in read_metrics(metrics, "skipped") if "environment" in r["reason"]]
    assert skipped and all("agent run raised RuntimeError: no such row" in r["reason"] for r in skipped)
