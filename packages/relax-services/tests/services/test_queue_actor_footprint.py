"""The run's queue actor stays free of the model stack while they hold and move real rows.

The feeder, a Rollout, the Reward and the Reference services run their real code here (in the test's process)
against the pipeline's own Ray queue actors, on the default run's synthetic dataset rows (text, image, audio,
video prompts); a trainer-side reader takes the complete rows, a snapshot is saved and restored in place; then
each actor process is asked which modules it has loaded. Before prompts crossed the queues as opaque payloads,
unpickling the first prompt row made each actor import torch, relax_modalities' dependencies and the models
package (≈ 450 MB of PSS per actor in the default run).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from relax_queue import FixedSizeBatcher, Payload, TransferQueue, estimate_nbytes

pytestmark = pytest.mark.integration

HEAVY = ("torch", "transformers", "relax_modalities", "relax_services")

LIGHT_HOST_MODULES = {
    "relax_services",
    "relax_services._lazy",
    "relax_services.hosting",
    "relax_services.hosting.light_host",
    "relax_services.faults",
    "relax_services.faults.monitor",
    "relax_services.weights",
    "relax_services.weights.stores",
}
"""What of :data:`HEAVY` the light actor's process may load: the modules of its weight store and health monitor."""


def _actor_modules(ray: Any, actor: Any) -> list[str]:
    def loaded(_self: object, heavy: tuple[str, ...] = HEAVY) -> list[str]:  # runs in the actor's process
        import sys

        return sorted(m for m in sys.modules if m.split(".")[0] in heavy)

    return list(ray.get(actor.__ray_call__.remote(loaded)))


def test_queue_actors_move_real_rows_without_the_model_stack(ray_session: Any, tmp_path: Path) -> None:
    from relax_services.config import load_run_config
    from relax_services.control.pipeline import _light_actor, queue_configs
    from relax_services.data.feeder import PromptFeeder, _prompt_row
    from relax_services.data.run_data import prepare_data
    from relax_services.services import ReferenceService, RewardService, RolloutService, trainer_fields
    from relax_services.weights import InProcessWeightStore

    cfg = load_run_config(None, ["trainer.groups_per_step=16"])  # one update = one Rollout call of 16 groups
    data = prepare_data(cfg, tmp_path)
    light = _light_actor(cfg, "footprint-test")
    prompt_queue, sample_queue = light.queues["prompts"], light.queues["samples"]
    try:
        feeder = PromptFeeder(data.stream, data.to_prompt, prompt_queue, sample_queue, cfg.algorithm.group_size, True)
        assert feeder.pump(max_groups=cfg.trainer.groups_per_step) == cfg.trainer.groups_per_step
        prompts = {key: data.to_prompt(feeder._items[key]) for key in feeder._items}  # built again, here
        tasks = {feeder._items[key]["task"] for key in prompts}
        assert {"image", "video"} & tasks, tasks  # media prompts, not only text, crossed the queue
        # The prompt queue counts each prompt at its pickle's length (the rest of a row: its small item dict).
        items = [_prompt_row(feeder._items[key], prompt)["item"] for key, prompt in prompts.items()]
        expected = sum(len(pickle.dumps(p, protocol=5)) for p in prompts.values()) + sum(map(estimate_nbytes, items))
        assert prompt_queue.metrics()["depth_bytes"] == expected

        rollout = RolloutService("rollout-0", cfg, prompt_queue, sample_queue, InProcessWeightStore())
        rollout.step()
        RewardService("reward", cfg, sample_queue).step()
        ReferenceService("reference", cfg, sample_queue).step()
        trainer = sample_queue.reader("trainer", trainer_fields(cfg), FixedSizeBatcher(cfg.samples_per_step))
        batch = trainer.get(timeout=30)
        assert len(batch) == cfg.samples_per_step
        for row in batch.rows:  # consumers get the prompt objects back, equal to the feeder's
            prompt_key = row.fields["meta"]["prompt_key"]
            assert row.fields["prompt"].fingerprint() == prompts[prompt_key].fingerprint()
            # The default run's full KL: one reference log-prob per token, no [L, V] distribution (the Trainer's
            # engine holds the reference itself).
            assert len(row.fields["ref_logprobs"]) == len(row.fields["response"]) and "ref_dist" not in row.fields

        snapshot = tmp_path / "samples.queue"
        sample_queue.save(str(snapshot))  # the trainer's batch is leased: restored, it is delivered again
        sample_queue.load(str(snapshot), reset_running=False)
        again = trainer.get(timeout=30)
        assert sorted(map(str, again.keys)) == sorted(map(str, batch.keys))
        assert {r.fields["prompt"].fingerprint() for r in again.rows} == {p.fingerprint() for p in prompts.values()}
        trainer.ack(again)

        in_process = TransferQueue(queue_configs(cfg)[1])  # the actor's file loads in any transport
        in_process.load(snapshot, reset_running=False)
        held = in_process.state_dict()["rows"]
        assert held and all(type(r["fields"]["prompt"]).__name__ == "OmniPrompt" for r in held)
        assert all(type(r["fields"]["prompt"]) is Payload for r in pickle.loads(snapshot.read_bytes())["rows"])

        assert prompt_queue.actor == sample_queue.actor == light.weights.actor == light.health  # one process
        # Its weight store and monitor bring only their own light modules (no torch, transformers or modalities).
        assert set(_actor_modules(ray_session, light.health)) <= LIGHT_HOST_MODULES
    finally:
        prompt_queue.shutdown()
        sample_queue.shutdown()
