"""``relax bench trl --config``: both sides get the same settings, prompts and reward from one run config, and the
table's figures follow from given numbers (the benchmark itself is run by hand: it installs TRL)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from relax_services.bench.trl import SCHEDULE_SLACK
from relax_services.bench.trl_config import config_hparams, config_overrides, differences, write_config_task
from relax_services.bench.trl_figures import (
    MemoryEstimate,
    SideResult,
    format_config_table,
    median_update_s,
    memory_estimate,
)
from relax_services.config import load_run_config

REWARD = """
def score(response, ground_truth, metadata):
    return 1.0 if response.strip() == ground_truth else 0.5 * (metadata.get("half") == response.strip())
"""


def _row(a: int, b: int, source: str) -> dict[str, object]:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"what is {a}+{b}?"}],
        "reward_model": {"ground_truth": str(a + b)},
        "extra_info": {"half": str(a)},
    }


def _config(tmp_path: Path) -> dict[str, object]:
    """A user's run config: a tiny Llama-shaped checkpoint folder, 6 training rows, 2 held-out rows, a file reward."""
    from relax_services.models.tiny_families import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "model", "llama", seed=0)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(_row(a, a + 1, "add")) + "\n" for a in range(6)), encoding="utf-8")
    held = tmp_path / "eval.jsonl"
    held.write_text("".join(json.dumps(_row(a, 2, "held")) + "\n" for a in (1, 3)), encoding="utf-8")
    (tmp_path / "reward.py").write_text(REWARD, encoding="utf-8")
    return {
        "model": {"source": str(model)},
        "data": {"train_files": [str(train)], "eval_files": [str(held)], "seed": 5},
        "reward": {"fn": f"{tmp_path / 'reward.py'}:score"},
        "algorithm": {"preset": "grpo", "group_size": 4, "kl_coef": 0.01, "clip_eps_high": 0.28, "entropy_coef": 0.0},
        "optimizer": {"lr": 3e-5, "weight_decay": 0.0, "schedule": "constant"},
        "staleness": {"tau": 1},
        "rollout": {"max_new_tokens": 5, "temperature": 0.9, "groups_per_call": 2},
        "trainer": {"groups_per_step": 4, "micro_batch_groups": 2, "total_steps": 4, "seed": 7},
        "run": {"threads": 1},
    }


def test_config_mode_gives_both_sides_the_same_settings_prompts_and_reward(tmp_path: Path) -> None:
    from relax_core import RewardRequest, RewardRunnerConfig, build_reward_runner
    from relax_services.data.files import train_stream
    from relax_services.data.run_data import PromptBuilder

    cfg = load_run_config(_config(tmp_path))
    hp = config_hparams(cfg, minutes=2.5)
    # The shared settings, read from the config by hand.
    assert (hp["group_size"], hp["groups_per_step"], hp["micro_batch_groups"]) == (4, 4, 2)
    assert (hp["updates"], hp["seed"]) == (4, 7)
    assert (hp["max_new_tokens"], hp["temperature"], hp["lr"], hp["beta"]) == (5, 0.9, 3e-5, 0.01)
    assert (hp["clip_eps"], hp["clip_eps_high"], hp["grad_clip"], hp["intra_op_threads"]) == (0.2, 0.28, 1.0, 1)
    assert hp["loss_type"] == {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}[cfg.algorithm.loss_agg_mode]
    assert hp["minutes"] == 2.5 and hp["gradient_checkpointing"] is False  # relax's default: activations kept
    recompute = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"activation_checkpointing": True})})
    assert config_hparams(recompute)["gradient_checkpointing"] is True

    work = tmp_path / "work"
    write_config_task(cfg, work, hp)
    task = json.loads((work / "task.json").read_text(encoding="utf-8"))
    count = (4 + SCHEDULE_SLACK) * 4
    schedule = (work / "data" / "schedule.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(schedule) == len(task["train"]) == count
    # Each pass over the 6 rows holds every row once (relax's stream shuffles within an epoch).
    passes = Counter(json.loads(line)["prompt"][0]["content"] for line in schedule[:6])
    assert passes == Counter(f"what is {a}+{a + 1}?" for a in range(6))

    # relax's side, under its overrides, reads the schedule in the order TRL's prompts list it, with the same ids.
    relax_cfg = load_run_config(_config(tmp_path), config_overrides(work, cfg, hp, "distributed"))
    assert relax_cfg.run.mode == "distributed" and relax_cfg.run.threads == hp["intra_op_threads"]
    assert relax_cfg.staleness.tau == 1 and relax_cfg.trainer.total_steps == 4
    assert relax_cfg.trainer.max_minutes == 2.5 and relax_cfg.trainer.target_reward is None
    assert relax_cfg.algorithm.group_size == 4 and relax_cfg.optimizer.lr == 3e-5
    stream, to_prompt = train_stream(relax_cfg.data), PromptBuilder(relax_cfg.model)
    for row in task["train"]:
        item = stream.next()
        assert to_prompt(item).input_ids.tolist() == row["ids"]
        assert row["ground_truth"] == item["ground_truth"] and row["data_source"] == "add"
        a = int(row["ground_truth"]) // 2  # a + (a + 1) = 2a + 1
        assert row["prompt"] == f"<|im_start|>user\nwhat is {a}+{a + 1}?<|im_end|>\n<|im_start|>assistant\n"
    assert [(r["ground_truth"], r["data_source"]) for r in task["eval"]] == [("3", "held"), ("5", "held")]

    # TRL's side scores with the runner built from the shared reward: the user's function, metadata included.
    runner = build_reward_runner(RewardRunnerConfig.model_validate(hp["reward"]))
    first = task["train"][0]
    a = first["extra_info"]["half"]
    requests = [
        RewardRequest(r, first["ground_truth"], first["data_source"], first["extra_info"])
        for r in (first["ground_truth"], a, "x")
    ]
    assert [o.score for o in runner.score(requests)] == [1.0, 0.5, 0.0]


def test_config_mode_names_what_trl_cannot_hold_equal(tmp_path: Path) -> None:
    source = _config(tmp_path)
    source["algorithm"] = {**source["algorithm"], "entropy_coef": 0.01, "kl_estimator": "k1"}  # type: ignore[dict-item]
    source["optimizer"] = {"lr": 3e-5, "schedule": "cosine", "warmup_steps": 2}
    notes = differences(load_run_config(source))
    assert any("entropy" in n for n in notes) and any("cosine" in n for n in notes) and any("k1" in n for n in notes)
    assert differences(load_run_config(_config(tmp_path))) == []


def test_memory_estimate_counts_the_checkpoint_parameters(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from relax_services.models.tiny_families import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "model", "llama", seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    params = sum(p.numel() for p in model.parameters())  # a tied embedding counts once, as in the file
    estimate = memory_estimate(folder)
    assert estimate == MemoryEstimate(params, 4 * params, 8 * params)
    assert estimate.rest(10**9) == 10**9 - 12 * params


def test_median_update_s_leaves_out_the_first_quarter_of_the_gaps() -> None:
    # gaps 9, 9, 1, 1, 1, 1, 2, 2: the first quarter (2 gaps) is warm-up; the median of 1, 1, 1, 1, 2, 2 is 1
    times = [0.0, 9.0, 18.0, 19.0, 20.0, 21.0, 22.0, 24.0, 26.0]
    assert median_update_s(times) == pytest.approx(1.0)
    assert median_update_s([0.0, 3.0]) == pytest.approx(3.0)
    assert median_update_s([5.0]) is None


def test_config_table_gives_figures_and_ratios_to_trl() -> None:
    trl = SideResult("TRL", 0.0, [10.0 + 4.0 * i for i in range(9)], [0.0] * 9, samples=32, wall_s=60.0)
    trl.peak_bytes, trl.heldout_reward, trl.cpu_s = 3_000_000_000, 0.5, 200.0
    trl.peak_processes = {"trl_side.py": [2_900_000_000], "python": [100_000_000]}
    relax = SideResult("relax distributed", 0.0, [10.0 + 3.0 * i for i in range(9)], [0.0] * 9, samples=32)
    relax.peak_bytes, relax.heldout_reward, relax.wall_s, relax.cpu_s = 3_600_000_000, 0.625, 50.0, 150.0
    relax.peak_processes = {"TrainerService": [2_000_000_000], "RolloutService": [800_000_000, 800_000_000]}
    relax.heldout_curve = [(12.4, 0.5), (40.0, 0.625)]
    estimate = MemoryEstimate(params=100_000_000, weights_bytes=400_000_000, optimizer_bytes=800_000_000)
    table = format_config_table([trl, relax], estimate, ["relax adds an entropy bonus"])
    assert "| updates | 9 | 9 |" in table
    assert "| median seconds per update | 4.00 s | 3.00 s (0.75×) |" in table
    assert "| held-out reward at the end | 0.500 | 0.625 |" in table
    assert "| CPU seconds of waited processes (Ray's workers missed) | 200 s | 150 s (0.75×) |" in table
    assert "| peak PSS of the process tree | 3,000 MB | 3,600 MB (1.20×) |" in table
    assert "|   weights (100,000,000 params × 4 B) | 400 MB | 400 MB |" in table
    assert "|   AdamW moments (2 × params × 4 B) | 800 MB | 800 MB |" in table
    # the rest: 3000 - 400 - 800 = 1800 MB and 3600 - 1200 = 2400 MB
    assert "| 1,800 MB | 2,400 MB |" in table
    assert "- TRL, per process at its peak (PSS): trl_side.py 2,900 MB, python 100 MB" in table
    assert "RolloutService ×2 800 MB + 800 MB" in table.split("relax distributed, per process")[1]
    assert "- relax distributed, held-out reward by seconds into its run: 12 s 0.500, 40 s 0.625" in table
    assert table.splitlines()[-1] == "- not held equal: relax adds an entropy bonus"


def test_command_line_model_without_config_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from relax_services.cli import main

    assert main(["bench", "trl", "--model", str(tmp_path), "--work", str(tmp_path)]) == 2
    assert "need --config" in capsys.readouterr().err
