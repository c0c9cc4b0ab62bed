"""ReMax's baseline: the Rollout scores each prompt's greedy response with the run's reward and hands it to its
samples (``meta.reward_baseline``); the Trainer's advantages are each sample's reward less it."""

from __future__ import annotations

import torch

from relax_core import build_reward_runner, compute_advantages
from relax_queue import QueueConfig, TaskSpec, TransferQueue
from relax_services.config import load_run_config
from relax_services.data.feeder import PromptFeeder
from relax_services.data.run_data import prepare_data
from relax_services.engines import HFRolloutConfig, HFRolloutEngine
from relax_services.engines.sampling import sampling_params
from relax_services.models.decoder import ResponseDecoder, checkpoint_folder
from relax_services.models.policy import build_policy
from relax_services.rows import as_prompt_row, reward_request
from relax_services.services.reward import decode_response
from relax_services.services.rollout import RolloutService
from relax_services.weights import InProcessWeightStore


def test_each_sample_carries_its_prompts_greedy_reward(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = load_run_config(
        None,
        [
            "algorithm.advantage_estimator=remax",
            "algorithm.group_size=2",
            "rollout.groups_per_call=3",
            "trainer.groups_per_step=3",
            "rollout.max_new_tokens=4",
        ],
    )
    data = prepare_data(cfg, tmp_path)
    prompts = TransferQueue(QueueConfig(tasks=(TaskSpec("rollout"),)))
    samples = TransferQueue(QueueConfig(tasks=(TaskSpec("trainer"),)))
    feeder = PromptFeeder(data.stream, data.to_prompt, prompts, samples, cfg.algorithm.group_size, True)
    assert feeder.pump(max_groups=3) == 3
    delivered = prompts.get("rollout", n=3, timeout=0)  # what the service will read, seen here first
    prompts.nack(delivered)
    rollout = RolloutService("rollout-0", cfg, prompts, samples, InProcessWeightStore())
    rollout.step()
    rows = {str(r.key): r.fields for r in samples.get("trainer", n=6, timeout=0).rows}
    assert len(rows) == 6

    # Independently: a fresh engine on the same weights decodes each prompt greedily; the run's reward scores it.
    engine = HFRolloutEngine(build_policy(cfg.model), HFRolloutConfig())
    params = sampling_params(cfg.model, n=1, max_new_tokens=4, temperature=0.0)
    runner = build_reward_runner(cfg.reward.runner_config())
    decoder = ResponseDecoder(checkpoint_folder(cfg.model.source, cfg.model.seed))
    try:
        for row in delivered.rows:
            fields = as_prompt_row(row.fields)
            (greedy,) = engine.generate([fields["prompt"]], params)
            (result,) = runner.score([reward_request(decode_response(greedy[0].token_ids, decoder), fields["item"])])
            for j in range(2):
                assert rows[f"{row.key}/{j}"]["meta"]["reward_baseline"] == result.score
    finally:
        runner.close()

    # ReMax's advantage of a sample is its reward less its prompt's baseline (one outcome reward per sample).
    rewards = torch.tensor([1.0, 0.0])
    out = compute_advantages(
        cfg.algorithm,
        rewards,
        torch.ones(2, 2),
        group_ids=["p", "p"],
        reward_baselines=torch.tensor([0.25, 0.25]),
    )
    assert torch.allclose(out.advantages, (rewards - 0.25)[:, None].expand(2, 2))  # the same at every token
