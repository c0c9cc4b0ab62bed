"""Size relations of a run config that would deadlock the sample queue, checked when the config loads.

The Trainer takes whole updates only (``trainer.groups_per_step × algorithm.group_size`` complete sample rows at
once), and a Rollout's put of new rows waits while the queue is at ``queue.max_rows`` rows or ``queue.max_bytes``
bytes. An update that cannot fit under either bound leaves the Trainer waiting for rows that the Rollout can
never put: a silent hang that the health manager would misread as a hung Rollout. The row bound is exact and
checked in :class:`~relax_services.config.RunConfig`; the byte bound needs a size for a row, which this module
estimates from the config as a lower bound (so a run it rejects would surely hang; one it accepts may still be
slow under byte backpressure, never stuck on this relation alone).

The Rollout's call size needs no check of its own: ``RunConfig.rollout_call_groups`` divides an update, so one
call's rows and bytes are at most an update's, and the prompt queue holds four updates' worth of prompt groups.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_services.config import RunConfig

__all__ = ["PER_TOKEN_FIELDS", "queue_bytes_problem", "sample_row_min_bytes"]

PER_TOKEN_FIELDS = ("response", "logprobs", "token_versions", "loss_mask")
"""The Rollout's per-token fields of a new sample row (``RolloutFields``), each a Python list of ``[L]`` scalars."""

_LIST_ITEM_BYTES = 16
"""What the queue's size estimate (relax-queue's ``estimate_nbytes``) counts per item of a list of scalars: 8 for the
slot and 8 for the scalar."""

_META_KEYS = ("task", "answer", "prompt_key")
_PROMPT_KEY_CHARS = 8  # the feeder's prompt keys: "p" and seven digits at least ("p0000000")


def sample_row_min_bytes(cfg: RunConfig) -> int:
    """A lower bound of the bytes the sample queue counts for one new sample row of ``cfg``'s Rollout.

    It counts what the queue's size estimate sees of a row when the Rollout puts it (fields added later by the
    Reward, Reference and Critic never block a put): a response of at least one token in each of
    :data:`PER_TOKEN_FIELDS` (16 bytes an item), the row's ``meta`` (its keys, the shortest task name of the
    synthetic tasks — none for dataset files, whose ``data_source`` may be empty — and the prompt key) and the
    ``prompt`` at the least any object counts (16 bytes). Conservative on purpose: the Ray queue counts a prompt
    (an ``OmniPrompt``) at its pickle's exact length (it crosses the queue as an opaque payload: tens of kB with
    an image or video, a few hundred bytes for text), but the in-process queue of ``run.mode=colocated`` still
    counts it as one opaque object, and responses may stop at their first token; counting more here would
    reject runs that do not hang in one transport or the other.
    """
    tokens = 1  # every response holds at least its first sampled token (the end token when it stops at once)
    per_token = len(PER_TOKEN_FIELDS) * _LIST_ITEM_BYTES * tokens
    task = 0 if cfg.data.train_files else min(len(t) for t in cfg.data.tasks)
    meta = sum(map(len, _META_KEYS)) + task + _PROMPT_KEY_CHARS
    prompt = sys.getsizeof(object())
    return per_token + meta + prompt


def queue_bytes_problem(cfg: RunConfig) -> str | None:
    """Why one update of ``cfg`` cannot fit under ``queue.max_bytes`` (a certain hang), or None when it may."""
    need = cfg.samples_per_step * sample_row_min_bytes(cfg)
    if need <= cfg.queue.max_bytes:
        return None
    return (
        f"trainer.groups_per_step={cfg.trainer.groups_per_step} × algorithm.group_size={cfg.algorithm.group_size} "
        f"= {cfg.samples_per_step} samples per update need at least {need} bytes "
        f"({sample_row_min_bytes(cfg)} a sample row), more than queue.max_bytes={cfg.queue.max_bytes}; the trainer "
        "would wait for an update the queue cannot hold. Raise queue.max_bytes or lower trainer.groups_per_step"
    )
