"""How a training engine cuts a batch into micro-batches: by sample count, or by a token budget.

A micro-batch's memory follows its tokens, not its samples: in the response forward of
:mod:`~relax_services.engines.scoring` every row holds its own copy of its prompt's keys and values and its response
tokens attend over ``prompt + response`` keys. So a sample's cost is its **prompt + response tokens**
(:func:`sample_tokens`). The modalities' ``estimate_cost`` adds the encoders' patches and frames, but a
:class:`~relax_services.engines.TrainSample` holds its prompt's ids (the media's placeholder tokens already counted
there) and the media are encoded once per distinct prompt, not per row.

The budget is filled by relax-queue's :class:`~relax_queue.TokenBudgetBatcher` (the queue's own token-budget
batcher), one sample per unit, in the batch's order: rows of a group stay together unless the budget cuts between
them, so their prompt still runs once per micro-batch.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from relax_queue import TokenBudgetBatcher
from relax_services.engines.protocols import TrainSample

logger = logging.getLogger(__name__)

__all__ = ["padded_response_slots", "sample_tokens", "split_micro_batches", "token_budget_micro_batches"]


def split_micro_batches(batch: Sequence[TrainSample], size: int) -> list[Sequence[TrainSample]]:
    """Consecutive micro-batches of at most ``size`` samples."""
    return [batch[i : i + size] for i in range(0, len(batch), size)]


def sample_tokens(sample: TrainSample) -> int:
    """A sample's cost in a micro-batch: its prompt's tokens plus its response's."""
    return int(sample.prompt.input_ids.numel()) + int(sample.response_ids.numel())


@dataclass(frozen=True)
class _Row:
    """A sample as the queue's batchers see a row (:class:`~relax_queue.RowMeta`): its index and token count."""

    key: Hashable
    tags: Mapping[str, int | float | str] = field(default_factory=dict)
    group_id: Hashable | None = None
    group_size: int | None = None


class _OversizeWarning:
    """Logs the first sample above the budget once per process (every later one is trained the same way)."""

    warned = False

    @classmethod
    def once(cls, tokens: int, budget: int) -> None:
        if not cls.warned:
            cls.warned = True
            logger.warning(
                "a sample of %d prompt + response tokens exceeds trainer.max_tokens_per_micro_batch=%d: it forms a "
                "micro-batch of its own (logged once)",
                tokens,
                budget,
            )


def token_budget_micro_batches(
    batch: Sequence[TrainSample], max_tokens: int, count: int | None = None
) -> list[Sequence[TrainSample]]:
    """Consecutive micro-batches of at most ``max_tokens`` prompt + response tokens (:func:`sample_tokens`).

    A sample above the budget forms a micro-batch of its own (never dropped; logged once). With ``count``, the
    micro-batches with the most samples are halved until there are ``count`` of them (ranks of a group must run
    as many forwards: each one gathers the sharded weights), which keeps every one within the budget.

    Args:
        batch: The samples, in the order their micro-batches keep.
        max_tokens: Token budget of one micro-batch (>= 1).
        count: Micro-batches wanted (at least the budget's own number, at most ``len(batch)``); None: the
            budget's own number.

    Raises:
        ValueError: If ``count`` is below the budget's number of micro-batches or above the number of samples.
    """
    tokens = [sample_tokens(s) for s in batch]
    batcher = TokenBudgetBatcher(max_tokens=max_tokens, partial=True)
    units = [[_Row(i, {"num_tokens": n})] for i, n in enumerate(tokens)]
    bounds: list[tuple[int, int]] = []
    start = 0
    while start < len(units):
        taken = batcher.select(iter(units[start:]), None)
        assert taken, "a partial TokenBudgetBatcher returns at least one unit"
        if len(taken) == 1 and tokens[start] > max_tokens:
            _OversizeWarning.once(tokens[start], max_tokens)
        bounds.append((start, start + len(taken)))
        start += len(taken)
    if count is not None:
        if not len(bounds) <= count <= len(batch):
            raise ValueError(
                f"cannot cut {len(batch)} samples into {count} micro-batches (the budget makes {len(bounds)})"
            )
        while len(bounds) < count:
            widest = max(range(len(bounds)), key=lambda i: bounds[i][1] - bounds[i][0])
            lo, hi = bounds[widest]
            mid = (lo + hi + 1) // 2
            bounds[widest : widest + 1] = [(lo, mid), (mid, hi)]
    return [batch[lo:hi] for lo, hi in bounds]


def padded_response_slots(micro_batches: Sequence[Sequence[TrainSample]], packed: bool) -> tuple[int, int]:
    """``(positions the response forwards run, real response tokens)`` of a step's micro-batches.

    A padded micro-batch runs ``B × L_max`` response positions; a packed one runs exactly its real tokens. (The
    distinct prompts' forward left-pads them in either case; that forward runs once per prompt, not per row.)
    """
    real = sum(int(s.response_ids.numel()) for m in micro_batches for s in m)
    if packed:
        return real, real
    run = sum(len(m) * max(int(s.response_ids.numel()) for s in m) for m in micro_batches)
    return run, real
