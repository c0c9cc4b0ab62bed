"""Size relations that would deadlock the sample queue are config errors naming both fields."""

from __future__ import annotations

import pytest

from relax_core import ConfigError
from relax_queue import Capacity, QueueConfig, QueueFullError, RowInput, TaskSpec, TransferQueue
from relax_services.config import RunConfig, load_run_config
from relax_services.config.sizes import sample_row_min_bytes
from relax_services.rows import RolloutFields, SampleMeta, sample_key

# Hand-derived from the queue's size estimate (relax-queue's estimate_nbytes) of a one-token Rollout row of the
# default task mix: response, logprobs, token_versions and loss_mask one item each at 16 bytes (8 the slot, 8 the
# scalar) = 64; meta keys "task" + "answer" + "prompt_key" = 20 characters, the shortest task name ("text") 4 and a
# prompt key of 8 ("p0000000") = 32; the prompt as one opaque object, 16. Total 112 a row; an update of the default
# 32 groups × 8 samples = 256 rows needs at least 256 × 112 = 28672 bytes.
DEFAULT_ROW_MIN = 112
DEFAULT_UPDATE_MIN = 256 * DEFAULT_ROW_MIN


def test_the_row_bound_is_the_hand_derived_figure() -> None:
    assert sample_row_min_bytes(load_run_config()) == DEFAULT_ROW_MIN
    # "image" (5 characters) is the shortest task name left: one byte more a row.
    assert sample_row_min_bytes(load_run_config(None, ["data.tasks=[image, audio_video]"])) == DEFAULT_ROW_MIN + 1


def test_an_update_larger_than_the_byte_bound_is_a_config_error_naming_both_fields() -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(None, [f"queue.max_bytes={DEFAULT_UPDATE_MIN - 1}"])
    text = str(info.value)
    assert "trainer.groups_per_step=32" in text and "algorithm.group_size=8" in text
    assert f"queue.max_bytes={DEFAULT_UPDATE_MIN - 1}" in text and str(DEFAULT_UPDATE_MIN) in text
    assert "{" not in text  # the message, not the whole input
    assert load_run_config(None, [f"queue.max_bytes={DEFAULT_UPDATE_MIN}"]).queue.max_bytes == DEFAULT_UPDATE_MIN
    # Fewer groups an update fit where the default does not.
    load_run_config(None, [f"queue.max_bytes={DEFAULT_UPDATE_MIN - 1}", "trainer.groups_per_step=16"])


def _one_token_rows(cfg: RunConfig, task: str, n: int) -> list[RowInput]:
    """``n`` real Rollout rows of ``task`` (the prompt of a real synthetic item) with one-token responses."""
    from relax_modalities.synthetic import TaskItem
    from relax_services.data.run_data import PromptBuilder

    prompt = PromptBuilder(cfg.model)(TaskItem(id="i", task=task, prompt="which? a b", media=()))
    rows = []
    for i in range(n):
        key = f"p{i:07d}"
        meta: SampleMeta = {"task": task, "answer": "", "prompt_key": key}
        fields: RolloutFields = {
            "prompt": prompt,
            "meta": meta,
            "response": [5],
            "logprobs": [-0.5],
            "token_versions": [0],
            "loss_mask": [1],
        }
        rows.append(RowInput(sample_key(key, 0), dict(fields), versions=0))
    return rows


def _sample_queue(max_bytes: int | None) -> TransferQueue:
    return TransferQueue(
        QueueConfig(tasks=(TaskSpec("trainer"),), capacity=Capacity(max_rows=None, max_bytes=max_bytes))
    )


def test_the_row_bound_is_below_what_the_queue_counts_for_a_real_row() -> None:
    """The smallest row a Rollout can put (one token, an empty answer, the shortest task) as the queue counts it."""
    cfg = load_run_config(None, ["data.tasks=[text]"])
    queue = _sample_queue(1 << 30)
    queue.put_many(_one_token_rows(cfg, "text", 1))
    assert queue.metrics()["depth_bytes"] >= sample_row_min_bytes(cfg)


def test_a_queue_under_the_rejected_bound_cannot_hold_one_update() -> None:
    """What the config check prevents: with ``queue.max_bytes`` below an update's bound, a whole update never fits,
    so the trainer (which takes whole updates) would wait forever."""
    overrides = ["data.tasks=[text]", "trainer.groups_per_step=2", "algorithm.group_size=2"]
    cfg = load_run_config(None, overrides)
    need = cfg.samples_per_step * sample_row_min_bytes(cfg)
    with pytest.raises(ConfigError, match=r"queue\.max_bytes"):
        load_run_config(None, [*overrides, f"queue.max_bytes={need - 1}"])
    queue = _sample_queue(need - 1)
    with pytest.raises(QueueFullError):
        queue.put_many(_one_token_rows(cfg, "text", cfg.samples_per_step), timeout=0.05)
    assert len(queue) < cfg.samples_per_step
