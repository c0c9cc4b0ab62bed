"""The rows that cross the queues: one schema for what each service writes and reads.

Rows are plain field dicts on the wire (the queue stores columns by name and a reader asks for the fields it
needs), so the schema is a set of ``TypedDict``s: free at run time, checked by the type checker wherever a
service builds or reads a row. Per-token lists are aligned with ``response`` (``[L]``: one entry per response
token).

Who writes what (the sample queue's fields, in the order they appear):

=============  =========================================================  =================================
service        writes                                                     reads
=============  =========================================================  =================================
feeder         prompt rows: :class:`PromptRow` or :class:`RecordRow`      —
Rollout        :class:`RolloutFields` (a new sample row)                  ``item``, ``prompt`` (prompt row)
Reward         :class:`RewardFields`                                      ``response``, ``meta``
Reference      :class:`ReferenceFields`                                   ``prompt``, ``response``
Critic         :class:`CriticFields`                                      ``prompt``, ``response``
Trainer        —                                                          :class:`SampleRow`
=============  =========================================================  =================================

A sample row's key is ``"<prompt key>/<j>"``, the ``j``-th completion of its prompt: :func:`sample_key` builds it
and :func:`split_sample_key` / :func:`prompt_key_of` read it (nothing else spells the format).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, cast

from relax_core import RewardRequest

if TYPE_CHECKING:
    from relax_services.models import OmniPrompt

__all__ = [
    "CriticFields",
    "DataItem",
    "HeldoutItem",
    "ItemInfo",
    "PromptRow",
    "RecordRow",
    "ReferenceFields",
    "RewardFields",
    "RolloutFields",
    "SampleMeta",
    "SampleRow",
    "as_prompt_row",
    "as_record_row",
    "as_sample_row",
    "item_extras",
    "loss_mask_of",
    "prompt_key_of",
    "reward_request",
    "sample_key",
    "split_sample_key",
]


class ItemInfo(TypedDict):
    """What a prompt row carries about its dataset entry.

    Attributes:
        id: Stable id of the entry (prompts are cached by it; skipped files are counted by it).
        task: Task name (``data_source``): rewards and per-task metrics group by it.
        answer: Ground truth handed to the reward function (as text).
        data_source: The row's ``data_source`` (dataset files only; routes the reward).
        ground_truth: The row's ground truth as the file holds it (dataset files only; any JSON value).
        extra_info: The row's ``extra_info`` (dataset files only), the reward's metadata.
        messages: The row's chat prompt as ``{"role", "content"}`` text messages, media as ``<kind>`` markers
            (dataset files only): what a ``rollout.env`` environment's ``reset`` reads.
        media: ``(kind, file)`` of the prompt's media, None for inline bytes (held-out items only): the samples
            files' links and thumbnails.
    """

    id: str
    task: str
    answer: str
    data_source: NotRequired[str]
    ground_truth: NotRequired[Any]
    extra_info: NotRequired[dict[str, Any]]
    messages: NotRequired[list[dict[str, str]]]
    media: NotRequired[list[tuple[str, str | None]]]


class DataItem(ItemInfo):
    """One dataset entry as the feeder streams it: :class:`ItemInfo` plus the loader's record.

    Attributes:
        item: The loader's own record (relax-modalities' ``TaskItem``): what the modality data path reads.
    """

    item: Any  # the loader's record: its type belongs to the data path that produced it


class PromptRow(TypedDict):
    """A row of the prompt queue (task ``rollout``): one prompt, to be sampled ``group_size`` times."""

    item: ItemInfo
    prompt: OmniPrompt  # model-ready inputs: input_ids [T] and the media tensors


class RecordRow(TypedDict):
    """A row of the prompt queue that carries its dataset row instead of the prompt (the distributed run's feeder
    builds no prompt: the Rollout worker does, so the driver never imports the data paths' model stack)."""

    item: ItemInfo
    record: DataItem  # the feeder item, the loader's record included
    cache_key: str | None  # what the worker may cache the built prompt under (the stream's key; None: not cached)


class SampleMeta(TypedDict):
    """What a sample row carries about its prompt (for rewards, groups and per-task metrics)."""

    task: str
    answer: str
    prompt_key: str  # the prompt row's key; the group id of the sample
    data_source: NotRequired[str]  # the item's, when it came from a dataset file (ItemInfo)
    ground_truth: NotRequired[Any]
    extra_info: NotRequired[dict[str, Any]]
    env_reward: NotRequired[float]  # a multi-turn episode's reward from its environment (rollout.env)
    reward_baseline: NotRequired[float]  # remax: the reward of the prompt's greedy response
    replica: NotRequired[str]  # the Rollout replica that generated it (its service name, e.g. rollout-1)


class RolloutFields(TypedDict):
    """What the Rollout service writes: a new sample row."""

    # The prompt the response continues. The sample of an episode whose environment showed media after the first turn
    # carries every item of the episode, in conversation order: the first fill the prompt's placeholders, the rest
    # the response's (environment tokens); the scoring path runs such a row as one forward of the whole conversation.
    prompt: OmniPrompt
    meta: SampleMeta
    response: list[int]  # [L] sampled token ids
    logprobs: list[float]  # [L] behaviour log-probs (the policy distribution at the sampling temperature)
    token_versions: list[int]  # [L] policy version of the weights that produced each token
    # [L] 1 on a token the policy sampled, 0 on an environment/tool token of a multi-turn episode (context only:
    # out of every loss, estimator and ratio; its logprobs entry is 0). Every producer writes it (the Trainer's
    # reader asks for it); an empty list means all policy tokens (what a restored snapshot of an older run's queue
    # gives its rows). Read it through loss_mask_of, which also takes a row without it as all policy tokens.
    loss_mask: list[int]


class RewardFields(TypedDict):
    """What the Reward service adds."""

    reward: float
    reward_error: str | None  # why the reward function failed (then reward = failure_reward)


class ReferenceFields(TypedDict, total=False):
    """What the Reference service adds (only when a KL term is used): one float per token for every estimator
    (the exact full-vocabulary KL is computed by the Trainer's engine, which holds the reference itself)."""

    ref_logprobs: list[float]  # [L] log-probs under the frozen initial policy


class CriticFields(TypedDict, total=False):
    """What the Critic service adds (PPO only)."""

    values: list[float]  # [L] critic values
    value_version: int  # version of the critic weights that scored them


class SampleRow(RolloutFields, RewardFields, ReferenceFields, CriticFields):
    """A complete sample row as the Trainer reads it: the rollout's and reward's fields always, the reference's
    and critic's when the algorithm uses them (:func:`~relax_services.services.trainer_fields`)."""


HeldoutItem = tuple[str, "OmniPrompt", ItemInfo]
"""A held-out prompt: ``(task, prompt, its item)``, never trained on."""

_RECORD_KEYS = ("data_source", "ground_truth", "extra_info")


def item_extras(info: Mapping[str, object]) -> dict[str, object]:
    """The dataset-file keys of an :class:`ItemInfo` (or a :class:`SampleMeta`) that it has."""
    return {k: info[k] for k in _RECORD_KEYS if k in info}


def reward_request(response: str, info: Mapping[str, object]) -> RewardRequest:
    """What the reward runner scores: ``response`` against an item's (or a sample's meta's) ground truth, with
    its ``data_source`` and ``extra_info``; a synthetic item's answer, task and no metadata otherwise."""
    return RewardRequest(
        response,
        info.get("ground_truth", info["answer"]),
        str(info.get("data_source", info["task"])),
        dict(cast("Mapping[str, object]", info.get("extra_info", {}))),
    )


def loss_mask_of(row: RolloutFields) -> list[int]:
    """``[L]`` the loss mask of a sample row: its ``loss_mask``, or all ones (every token the policy's) when the
    row has none or an empty one.

    Raises:
        ValueError: If the row's mask does not have one entry per response token.
    """
    mask = row.get("loss_mask") or [1] * len(row["response"])
    if len(mask) != len(row["response"]):
        raise ValueError(f"loss_mask has {len(mask)} entries for a response of {len(row['response'])} tokens")
    return mask


def sample_key(prompt_key: Hashable, index: int) -> str:
    """The key of the ``index``-th completion of prompt ``prompt_key``: ``"<prompt key>/<index>"``."""
    return f"{prompt_key}/{index}"


def split_sample_key(key: Hashable) -> tuple[str, int]:
    """``(prompt key, index in group)`` of a sample row key made by :func:`sample_key`.

    Raises:
        ValueError: If ``key`` is not ``"<prompt key>/<int>"``.
    """
    prompt, sep, index = str(key).rpartition("/")
    if not sep or not prompt or not index.isdigit():
        raise ValueError(f"sample row key {key!r} is not '<prompt key>/<index>'")
    return prompt, int(index)


def prompt_key_of(key: Hashable) -> str:
    """The prompt key a row key belongs to: a sample row's prompt (:func:`split_sample_key`'s first part), or a
    prompt row's own key (prompt keys hold no ``/``)."""
    text = str(key)
    return split_sample_key(text)[0] if "/" in text else text


def as_sample_row(fields: Mapping[str, object]) -> SampleRow:
    """View the field dict a reader delivered as a :class:`SampleRow` (no copy, no run-time check: the queue
    delivers only rows that have every field the reader asked for)."""
    return cast("SampleRow", fields)


def as_prompt_row(fields: Mapping[str, object]) -> PromptRow:
    """View a prompt queue row's field dict as a :class:`PromptRow` (as :func:`as_sample_row`)."""
    return cast("PromptRow", fields)


def as_record_row(fields: Mapping[str, object]) -> RecordRow:
    """View a prompt queue row's field dict as a :class:`RecordRow` (as :func:`as_sample_row`)."""
    return cast("RecordRow", fields)
