"""Fixtures of the integration tests: small, fast pipeline runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from relax_core import (
    broadcast_to_tokens,
    compute_policy_loss,
    exact_match_reward,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    outcome_token_rewards,
    value_loss,
)
from relax_modalities import build_stream
from relax_services.config import RunConfig, load_run_config
from relax_services.control.controller import Controller, RunResult
from relax_services.data.files import record_item
from relax_services.data.run_data import prepare_data
from relax_services.engines import HFRolloutConfig, HFRolloutEngine, LossInputs, TrainSample
from relax_services.engines.sampling import sampling_params
from relax_services.engines.torch import build_train_engine, build_value_engine
from relax_services.models.policy import build_policy, checkpoint_of
from relax_services.services import decode_response, sampling_seed

FAST = [
    "data.train_per_task=16",
    "data.eval_per_task=8",
    "trainer.groups_per_step=4",
    "trainer.micro_batch_groups=2",
    "trainer.target_reward=null",
    "trainer.max_minutes=20",  # a safety net only: start-up counts too, minutes on a loaded 2-core machine
    "trainer.warmup_format_steps=0",
    "rollout.groups_per_call=2",
    "eval.every_steps=1000",
    "run.progress=none",
    "algorithm.group_size=4",
    "algorithm.kl_coef=0.0",
]


# Ray's memory monitor kills workers when the whole machine's memory use passes its threshold, other tenants'
# processes included: the `relax train` runs below need a few GB, so their outcome must not depend on what else runs.
CLI_ENV = {
    **os.environ,
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "OMP_NUM_THREADS": "1",
    "RAY_memory_monitor_refresh_ms": "0",
}
"""The environment of every ``relax train`` subprocess started by these tests (each starts its own Ray)."""

CLI_FAST = [
    "data.train_per_task=8",
    "data.eval_per_task=4",
    "data.tasks=[image, audio, video, text]",
    "trainer.groups_per_step=4",
    "trainer.micro_batch_groups=4",
    "trainer.total_steps=4",
    "trainer.warmup_format_steps=2",
    "trainer.checkpoint_every=2",
    "algorithm.group_size=4",
    "eval.every_steps=2",
    "run.report_every_s=1",
]
"""A short whole ``relax train`` run (the CLI's overrides): warm-up, checkpoints with the HF export, evaluations and
every media task, so each path that runs in the driver is taken."""

# `python -m relax_services.cli train ARGS` (runpy runs the module as __main__, as -m does), then what the driver
# process holds at its end: the model-stack modules and whether libtorch is mapped into it.
_CLI_DRIVER = """
import json, runpy, sys
sys.argv = ["relax_services.cli", "train", *sys.argv[1:]]
try:
    runpy.run_module("relax_services.cli", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exit:
    code = exit.code
maps = open("/proc/self/maps").read()  # the shared libraries mapped into this process
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(json.dumps({"code": code, "modules": heavy, "libtorch": "libtorch" in maps}))
"""


@dataclass(frozen=True)
class CliRun:
    """One finished ``relax train`` subprocess run of ``CLI_FAST``."""

    proc: subprocess.CompletedProcess[str]
    """The driver process: its exit status and captured output (the progress lines, then the verdict line)."""
    run_dir: Path
    """The run's folder (``run.output_dir / run.name``)."""
    verdict: dict[str, Any]
    """The driver's last line: ``code`` (main's exit status), ``modules`` (torch / transformers modules it had
    imported at its end) and ``libtorch`` (whether libtorch was mapped into it)."""


@pytest.fixture
def cli_env() -> dict[str, str]:
    """``CLI_ENV``: the environment for a ``relax train`` subprocess (a copy, for the test to extend)."""
    return dict(CLI_ENV)


@pytest.fixture
def cli_fast() -> list[str]:
    """``CLI_FAST``: the short run's dotted overrides (a copy, for the test to extend)."""
    return list(CLI_FAST)


@pytest.fixture(scope="session")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    """``relax train`` with ``CLI_FAST`` from the command line, run once for the session: the CLI's run-folder test
    and the light-driver test check the same run, each for what it is about."""
    out = tmp_path_factory.mktemp("cli")
    args = [*CLI_FAST, f"run.output_dir={out}", "run.name=cli"]
    proc = subprocess.run(
        [sys.executable, "-c", _CLI_DRIVER, *args], capture_output=True, text=True, timeout=900, env=CLI_ENV, cwd=out
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return CliRun(proc=proc, run_dir=out / "cli", verdict=json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.fixture
def small_config(tmp_path: Path) -> Callable[..., RunConfig]:
    """Factory: a fast run config writing under the test's tmp_path, plus the given dotted overrides."""

    def make(*overrides: str) -> RunConfig:
        return load_run_config(None, [*FAST, f"run.output_dir={tmp_path}", "run.name=run", *overrides])

    return make


@pytest.fixture
def run_pipeline(ray_session: object) -> Callable[[RunConfig], RunResult]:
    """Runs a config to its end with the session's Ray instance; returns the run's result."""

    def run(cfg: RunConfig) -> RunResult:
        run_dir = cfg.run.output_dir / (cfg.run.name or "run")
        run_dir.mkdir(parents=True, exist_ok=True)
        return Controller(cfg, run_dir).run()

    return run


def _sequential_weights(
    cfg: RunConfig, data_dir: Path, steps: int, *, trace: dict[int, dict[str, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """A plain synchronous loop written from relax-core functions and the engines (no queue, no services):
    GRPO, or on-policy PPO with a critic (GAE) when the config's estimator is ``gae``. With a critic, the
    critic's weights are returned too, under keys prefixed ``critic.``. ``trace``, when given, receives the
    policy's weights after every update, by version (to find the first update a run's checkpoints left)."""
    critic = build_value_engine(cfg) if cfg.algorithm.advantage_estimator == "gae" else None
    data = prepare_data(cfg, data_dir)
    # The rows in the order the feeder draws them (without adaptive weights): an independent stream over the
    # same files, schema, seed and buffer, read by relax-modalities.
    stream = build_stream(
        data.train_files, cfg.data.schema_, shuffle_buffer=cfg.data.shuffle_buffer, seed=cfg.data.seed, epochs=None
    )
    policy = build_train_engine(cfg)
    rollout = HFRolloutEngine(build_policy(cfg.model), HFRolloutConfig(partial_rollout=cfg.rollout.partial_rollout))
    params = sampling_params(
        cfg.model,
        n=cfg.algorithm.group_size,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
    )
    tokenizer = checkpoint_of(cfg.model).tokenizer
    index = 0
    for step in range(steps):
        groups = []
        for _ in range(cfg.trainer.groups_per_step):
            item = record_item(next(stream))
            groups.append((f"p{index:07d}", item))
            index += 1
        rollout.load_weights(policy.policy_state(), step)
        samples, scores, group_ids, behaviour = [], [], [], []
        per_call = cfg.rollout_call_groups
        for start in range(0, len(groups), per_call):
            chunk = groups[start : start + per_call]
            rollout.generator.manual_seed(sampling_seed(cfg.trainer.seed, [k for k, _ in chunk]))
            prompts = [data.to_prompt(item) for _, item in chunk]
            for (key, item), prompt, completions in zip(chunk, prompts, rollout.generate(prompts, params), strict=True):
                for c in completions:
                    samples.append(TrainSample(prompt=prompt, response_ids=torch.tensor(c.token_ids)))
                    scores.append(exact_match_reward(decode_response(c.token_ids, tokenizer), item["answer"]))
                    group_ids.append(key)
                    behaviour.append(torch.tensor(c.logprobs))
        if critic is None:
            adv = grpo_advantages(torch.tensor(scores), group_ids, norm_by_std=cfg.algorithm.norm_adv_by_std)  # [B]
            for sample, a, lp in zip(samples, adv, behaviour, strict=True):
                sample.fields["old_logprobs"] = lp
                sample.fields["advantages"] = broadcast_to_tokens(a.reshape(1), torch.ones(1, len(lp)))[0]
        else:
            values, mask = critic.compute_values(samples)  # [B, T]
            token_adv, returns = gae_advantages(
                outcome_token_rewards(torch.tensor(scores), mask), values, mask, cfg.algorithm.gamma, cfg.algorithm.lam
            )
            if cfg.algorithm.whiten_advantages:
                token_adv = masked_whiten(token_adv, mask)
            for i, (sample, lp) in enumerate(zip(samples, behaviour, strict=True)):
                n = len(lp)
                sample.fields.update(
                    old_logprobs=lp, advantages=token_adv[i, :n], old_values=values[i, :n], returns=returns[i, :n]
                )

        # Decoupled PPO's proximal policy is the one before the update: with several optimizer steps per update
        # (minibatches, epochs) its log-probs are taken once up front, otherwise the step's own forward is it.
        if cfg.algorithm.decoupled and cfg.trainer.minibatches * cfg.trainer.ppo_epochs > 1:
            before, _ = policy.compute_logprobs(samples)  # [B, T]
            for i, sample in enumerate(samples):
                sample.fields["proximal"] = before[i, : len(sample.response_ids)]

        def loss_fn(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
            proximal = inputs.fields.get("proximal", inputs.logprobs.detach())
            return compute_policy_loss(
                cfg.algorithm,
                inputs.logprobs,
                inputs.fields["old_logprobs"],
                inputs.fields["advantages"],
                inputs.mask,
                proximal_logprobs=proximal if cfg.algorithm.decoupled else None,
                entropy=inputs.entropy,
            )

        def critic_loss(inputs: LossInputs) -> torch.Tensor:
            assert inputs.values is not None
            f = inputs.fields
            vf, _ = value_loss(
                inputs.values, f["old_values"], f["returns"], inputs.mask, cfg.algorithm.value_clip_eps, "token-mean"
            )
            return cfg.algorithm.value_loss_coef * vf

        policy.step(samples, loss_fn)
        if critic is not None:
            critic.step(samples, critic_loss)
        if trace is not None:
            trace[step + 1] = policy.policy_state()
    weights = policy.policy_state()
    if critic is not None:
        weights.update({f"critic.{k}": v for k, v in critic.policy_state().items()})
    return weights


@pytest.fixture
def sequential_weights() -> Callable[[RunConfig, Path, int], dict[str, torch.Tensor]]:
    """The synchronous reference trainer: ``(cfg, data_dir, steps) -> weights after that many updates``."""
    return _sequential_weights
