"""A full-KL run moves no field of size V per token through the queue: the Reference service scores real rows of a
real queue, the Trainer's reader takes them, and one update of the Trainer's engine (which holds the reference
itself) computes the exact KL from them."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from relax_queue import Capacity, FixedSizeBatcher, QueueConfig, RowInput, TaskSpec, TransferQueue, estimate_nbytes
from relax_services.config import load_run_config
from relax_services.engines.torch import build_train_engine
from relax_services.models import OmniPrompt
from relax_services.models.tiny_families import write_tiny_checkpoint
from relax_services.services import ReferenceService, build_train_samples, make_loss_fn, trainer_fields

VOCAB = 4096
LENGTH = 48  # response tokens per row
GROUPS, GROUP_SIZE = 2, 4


def _rows(suppressed: tuple[int, ...]) -> list[RowInput]:
    """What the Rollout and Reward services write for 2 groups of 4: text prompts, responses of the tiny
    tokenizer's characters (never a suppressed id), behaviour log-probs of a uniform policy, rewards."""
    gen = torch.Generator().manual_seed(0)
    uniform = -math.log(VOCAB - len(suppressed))
    rows = []
    for g in range(GROUPS):
        prompt = OmniPrompt(torch.randint(12, 64, (16,), generator=gen))
        for i in range(GROUP_SIZE):
            response = torch.randint(12, 64, (LENGTH - i,), generator=gen).tolist()
            fields = {
                "prompt": prompt,
                "meta": {"task": "text", "answer": "", "prompt_key": f"p{g}"},
                "response": response,
                "logprobs": [uniform] * len(response),
                "token_versions": [0] * len(response),
                "loss_mask": [1] * len(response),
                "reward": float(i % 2),
                "reward_error": None,
            }
            rows.append(RowInput(f"p{g}/{i}", fields, versions=0, group_id=f"p{g}", group_size=GROUP_SIZE))
    return rows


def test_full_kl_rows_carry_no_field_of_vocabulary_size_and_the_update_computes_the_kl(tmp_path: Path) -> None:
    """Every row the Trainer reads stays below ``L · V · 4 / 10`` bytes (a tenth of one float32 ``[L, V]``
    distribution, the field the Reference used to write), by the queue's own sizing (``estimate_nbytes``, and its
    ``depth_bytes``); the update's KL (the engine's, against its own frozen reference) is finite and positive."""
    folder = write_tiny_checkpoint(
        tmp_path / "qwen2", "qwen2", shape={"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2}
    )
    cfg = load_run_config(
        None,
        [
            f"model.source={folder}",
            "algorithm.kl_estimator=full",
            f"algorithm.group_size={GROUP_SIZE}",
            f"trainer.groups_per_step={GROUPS}",
            f"trainer.micro_batch_groups={GROUPS}",
        ],
    )
    assert cfg.algorithm.uses_full_kl
    dist_bytes = LENGTH * VOCAB * 4  # one [L, V] float32 distribution: 786 kB
    # The queue itself refuses a row that grows to one [L, V] distribution (RowTooLargeError naming the field).
    capacity = Capacity(max_bytes=dist_bytes)
    queue = TransferQueue(QueueConfig(tasks=(TaskSpec("reference"), TaskSpec("trainer")), capacity=capacity))
    engine = build_train_engine(cfg)
    queue.put_many(_rows(engine.config.suppressed_ids))
    ReferenceService("reference", cfg, queue, batch_rows=GROUPS * GROUP_SIZE).step()

    assert "ref_dist" not in trainer_fields(cfg)
    batch = queue.reader("trainer", trainer_fields(cfg), FixedSizeBatcher(GROUPS * GROUP_SIZE)).get(timeout=5)
    assert len(batch) == GROUPS * GROUP_SIZE
    for row in batch.rows:
        assert len(row.fields["ref_logprobs"]) == len(row.fields["response"])
        assert estimate_nbytes(dict(row.fields)) < len(row.fields["response"]) * VOCAB * 4 / 10
    assert 0 < queue.metrics()["depth_bytes"] < len(batch) * dist_bytes / 10

    samples = build_train_samples(cfg, [dict(r.fields) for r in batch.rows])  # type: ignore[misc]
    metrics = engine.step(samples, make_loss_fn(cfg))
    # A uniform-looking random tiny model against itself: the first update's KL is exactly 0 before the step.
    assert engine.reference is not None and math.isfinite(metrics["loss"]) and metrics["kl"] == 0.0
    after = engine.step(samples, make_loss_fn(cfg))
    assert after["kl"] > 0.0  # the policy moved away from its frozen reference
