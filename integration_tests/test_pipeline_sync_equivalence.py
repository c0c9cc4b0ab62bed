"""τ = 0 reproduces a synchronous trainer exactly: same samples, same updates, same weights.

The reference is a plain sequential loop written here from relax-core functions (rewards, GRPO advantages,
the policy loss) and the engines: generate a step's groups with the current weights, score, compute advantages,
update, repeat. The asynchronous pipeline (separate Rollout, Reward and Trainer processes joined by the queue)
must end with bit-identical weights.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from relax_core import broadcast_to_tokens, compute_policy_loss, exact_match_reward, grpo_advantages
from relax_services._data import prepare_data, to_prompt
from relax_services._policy import build_policy, build_train_engine
from relax_services.checkpoint import CheckpointManager
from relax_services.engines import HFRolloutConfig, HFRolloutEngine, LossInputs, SamplingParams, TrainSample
from relax_services.feeder import TaskStream
from relax_services.services import decode_response, sampling_seed

STEPS = 3


def _sequential_weights(cfg, data_dir: Path) -> dict[str, torch.Tensor]:
    data = prepare_data(cfg, data_dir)
    streams = {task: TaskStream(s.items, seed=cfg.data.seed) for task, s in data.streams.items()}
    tasks = sorted(streams)
    choose = random.Random(cfg.data.seed)
    policy = build_train_engine(cfg)
    rollout = HFRolloutEngine(build_policy(cfg.model), HFRolloutConfig(partial_rollout=cfg.rollout.partial_rollout))
    params = SamplingParams(
        n=cfg.algorithm.group_size, max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature
    )
    index = 0
    for step in range(STEPS):
        groups = []
        for _ in range(cfg.trainer.groups_per_step):
            item = streams[choose.choice(tasks)].next()
            groups.append((f"p{index:07d}", item))
            index += 1
        rollout.load_weights(policy.policy_state(), step)
        samples, scores, group_ids, behaviour = [], [], [], []
        per_call = cfg.rollout.groups_per_call
        for start in range(0, len(groups), per_call):
            chunk = groups[start : start + per_call]
            rollout.generator.manual_seed(sampling_seed(cfg.trainer.seed, [k for k, _ in chunk]))
            prompts = [to_prompt(item) for _, item in chunk]
            for (key, item), prompt, completions in zip(chunk, prompts, rollout.generate(prompts, params), strict=True):
                for c in completions:
                    samples.append(TrainSample(prompt=prompt, response_ids=torch.tensor(c.token_ids)))
                    scores.append(exact_match_reward(decode_response(c.token_ids), item["answer"]))
                    group_ids.append(key)
                    behaviour.append(torch.tensor(c.logprobs))
        adv = grpo_advantages(torch.tensor(scores), group_ids, norm_by_std=cfg.algorithm.norm_adv_by_std)  # [B]
        for sample, a, lp in zip(samples, adv, behaviour, strict=True):
            sample.fields["old_logprobs"] = lp
            sample.fields["advantages"] = broadcast_to_tokens(a.reshape(1), torch.ones(1, len(lp)))[0]

        def loss_fn(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
            return compute_policy_loss(
                cfg.algorithm,
                inputs.logprobs,
                inputs.fields["old_logprobs"],
                inputs.fields["advantages"],
                inputs.mask,
                proximal_logprobs=inputs.logprobs.detach(),
                entropy=inputs.entropy,
            )

        policy.step(samples, loss_fn)
    return policy.policy_state()


@pytest.mark.integration
def test_tau0_pipeline_equals_sequential_trainer(small_config, run_pipeline, tmp_path: Path) -> None:
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

    expected = _sequential_weights(cfg, tmp_path / "sequential")
    initial = build_policy(cfg.model).state_dict()
    assert any(not torch.equal(initial[k], expected[k]) for k in expected), "the reference loop did not train"
    mismatched = [k for k in expected if not torch.equal(pipeline_weights[k], expected[k])]
    assert not mismatched, f"{len(mismatched)} tensors differ, e.g. {mismatched[:3]}"
