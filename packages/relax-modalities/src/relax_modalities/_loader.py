"""Checkpointable loading pipeline on torchdata.nodes: items → parallel decode → skip bad → prefetch.

Graph: ``_ItemSource`` (seeded per-epoch shuffle, state = epoch and position) →
``ParallelMapper`` (threads decode and process media, in order, so the sample sequence does not
depend on timing) → ``_SkipBad`` (drops failed items and counts them: a `MediaError` by modality
and reason, any other exception from one item as ``"item: <type>"``) → ``Prefetcher`` (bounded
look-ahead) → ``Loader``. ``Loader.state_dict()`` snapshots every node at the last sample handed
out, so restoring it resumes with exactly the next sample.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode, Loader, ParallelMapper, Prefetcher

from relax_modalities._bands import available_cpus
from relax_modalities._collate import estimate_cost
from relax_modalities._errors import MediaError
from relax_modalities._sample import ProcessorSettings, SampleProcessor
from relax_modalities.synthetic._manifest import TaskItem, read_manifest
from relax_modalities.text import Tokenizer

_log = logging.getLogger(__name__)


@dataclass
class ProcessedSample:
    """One item and its thinker kwargs.

    Attributes:
        item: the manifest item (prompt, answer, options, …).
        inputs: `process_sample` output for it.
        cost: `estimate_cost` of ``inputs``.
    """

    item: TaskItem
    inputs: dict[str, torch.Tensor]
    cost: float


@dataclass
class LoaderStats:
    """Bad inputs the loader skipped.

    Attributes:
        skipped: total skipped samples.
        by_reason: ``"<modality>: <reason>"`` → count (reasons cut at the first ``:`` or ``(``); an item
            that failed with another exception than `MediaError` counts as ``"item: <exception type>"``.
        last_errors: the most recent error messages (at most 16).
    """

    skipped: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    last_errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Bad:
    """An item that failed: counted under ``key`` (``"<modality>: <reason>"``), described by ``message``."""

    item_id: str
    key: str
    message: str

    @classmethod
    def of(cls, item_id: str, exc: Exception) -> _Bad:
        if isinstance(exc, MediaError):
            short = exc.reason.split(":")[0].split("(")[0].strip()
            return cls(item_id, f"{exc.modality}: {short}", str(exc))
        # Not a media file's fault (a tokenizer, a template, a bug): still one item, so skipped and
        # counted, never the end of the loader; the traceback goes to the log for whoever debugs it.
        _log.warning("loader: item %r failed with %s; skipped", item_id, type(exc).__name__, exc_info=exc)
        return cls(item_id, f"item: {type(exc).__name__}", f"{type(exc).__name__}: {exc}")


class _ItemSource(BaseNode[TaskItem]):  # type: ignore[misc]  # torchdata ships no type hints
    """Items in a per-epoch order seeded by ``(seed, epoch)``; ``num_epochs=None`` repeats forever."""

    def __init__(self, items: Sequence[TaskItem], shuffle: bool, seed: int, num_epochs: int | None) -> None:
        super().__init__()
        if not items:
            raise ValueError("the loader needs at least one item")
        self.items = list(items)
        self.shuffle, self.seed, self.num_epochs = shuffle, seed, num_epochs
        self._epoch, self._pos, self._started = 0, 0, False
        self._order = np.arange(len(self.items))

    def _make_order(self) -> None:
        n = len(self.items)
        self._order = np.random.default_rng([self.seed, self._epoch]).permutation(n) if self.shuffle else np.arange(n)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self._epoch, self._pos = int(initial_state["epoch"]), int(initial_state["pos"])
        else:
            if self._started:  # a new pass over a finite loader starts the next epoch
                self._epoch += 1
            self._pos = 0
        self._started = False
        self._make_order()

    def next(self) -> TaskItem:
        self._started = True
        if self._pos >= len(self.items):
            if self.num_epochs is not None and self._epoch + 1 >= self.num_epochs:
                raise StopIteration
            self._epoch += 1
            self._pos = 0
            self._make_order()
        item = self.items[int(self._order[self._pos])]
        self._pos += 1
        return item

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "pos": self._pos}


class _SkipBad(BaseNode[ProcessedSample]):  # type: ignore[misc]  # torchdata ships no type hints
    """Drops `_Bad` results and counts them; the counts are part of the state."""

    def __init__(self, source: BaseNode[ProcessedSample | _Bad]) -> None:
        super().__init__()
        self.source = source
        self.stats = LoaderStats()

    @staticmethod
    def stats_from_state(state: Mapping[str, Any]) -> LoaderStats:
        return LoaderStats(
            skipped=int(state["skipped"]),
            by_reason=Counter(state["by_reason"]),
            last_errors=list(state["last_errors"]),
        )

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.source.reset(initial_state["source"])
            self.stats = self.stats_from_state(initial_state)
        else:
            self.source.reset(None)

    def next(self) -> ProcessedSample:
        while True:
            out: ProcessedSample | _Bad = next(self.source)
            if isinstance(out, ProcessedSample):
                return out
            self.stats.skipped += 1
            self.stats.by_reason[out.key] += 1
            self.stats.last_errors = [*self.stats.last_errors[-15:], f"{out.item_id}: {out.message}"]

    def get_state(self) -> dict[str, Any]:
        return {
            "source": self.source.state_dict(),
            "skipped": self.stats.skipped,
            "by_reason": dict(self.stats.by_reason),
            "last_errors": list(self.stats.last_errors),
        }


class OmniLoader:
    """Iterable of `ProcessedSample` with ``state_dict``/``load_state_dict`` that resume exactly.

    Build it with `build_loader`. Iterating again after a finite pass starts the next epoch.
    """

    def __init__(self, root: BaseNode[ProcessedSample], skip: _SkipBad) -> None:
        self._loader = Loader(root, restart_on_stop_iteration=True)
        self._root = root
        self._skip = skip

    def close(self) -> None:
        """Stop the decode and prefetch threads now, from the calling thread.

        torchdata otherwise stops them in its iterators' ``__del__``, which the garbage collector may run on one
        of those very threads (it then fails to join itself). Iterating again after ``close`` starts afresh.
        """
        for node in (self._root, self._skip.source):
            it = getattr(node, "_it", None)
            for _ in range(3):  # torchdata nests its threaded iterators (mapper → impl → iterator)
                shutdown = getattr(it, "_shutdown", None)
                if callable(shutdown):
                    shutdown()
                it = getattr(it, "_it", None)

    def __enter__(self) -> OmniLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[ProcessedSample]:
        return iter(self._loader)

    @property
    def stats(self) -> LoaderStats:
        """Counts of skipped bad inputs so far (restored with the state)."""
        return self._skip.stats

    def state_dict(self) -> dict[str, Any]:
        """Snapshot at the last sample handed out."""
        state: dict[str, Any] = self._loader.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a snapshot; the next sample is the one after the snapshot's last."""
        self._loader.load_state_dict(dict(state))
        # torchdata applies the state lazily on the next iteration; make the counts visible now.
        # The root is our Prefetcher, whose snapshot is the _SkipBad state.
        self._skip.stats = _SkipBad.stats_from_state(state["root"]["snapshot"])


def worker_settings(settings: ProcessorSettings, num_workers: int) -> ProcessorSettings:
    """``settings`` for ``num_workers`` decode threads sharing the CPUs.

    The workers process images at the same time, so each gets at most ``available_cpus() //
    num_workers`` threads per image (at least 1) instead of ``settings.image.threads_per_image``
    each: more would only oversubscribe the cores (on 2 CPUs the default 2 workers process each
    image on 1 thread; 1 worker keeps 2). A lower ``threads_per_image`` in ``settings`` is kept.
    """
    threads = min(settings.image.threads_per_image, max(1, available_cpus() // num_workers))
    if threads == settings.image.threads_per_image:
        return settings
    return settings.with_modality("image", replace(settings.image, threads_per_image=threads))


def assemble_graph(
    source: BaseNode[TaskItem],
    tokenizer: Tokenizer,
    settings: ProcessorSettings | None,
    num_workers: int,
    prefetch: int,
) -> tuple[BaseNode[ProcessedSample], _SkipBad]:
    """Wire ``source`` → parallel decode → skip bad → prefetch; return the root and the skip node."""
    if num_workers < 1 or prefetch < 1:
        raise ValueError(f"num_workers and prefetch must be >= 1, got {num_workers}, {prefetch}")
    processor = SampleProcessor(tokenizer, worker_settings(settings or ProcessorSettings(), num_workers))

    def work(item: TaskItem) -> ProcessedSample | _Bad:
        try:
            inputs = processor(item)
        except Exception as exc:  # one item's failure, whatever it is, skips that item only
            return _Bad.of(item.id, exc)
        return ProcessedSample(item, inputs, estimate_cost(inputs))

    decoded: BaseNode[ProcessedSample | _Bad] = ParallelMapper(
        source, work, num_workers=num_workers, in_order=True, method="thread"
    )
    skip = _SkipBad(decoded)
    return Prefetcher(skip, prefetch_factor=prefetch), skip


def load_items(manifest: str | os.PathLike[str] | Sequence[TaskItem]) -> list[TaskItem]:
    """Items of a manifest path, or the given items as a list."""
    return read_manifest(manifest) if isinstance(manifest, (str, os.PathLike)) else list(manifest)


def build_loader(
    manifest: str | os.PathLike[str] | Sequence[TaskItem],
    tokenizer: Tokenizer,
    settings: ProcessorSettings | None = None,
    *,
    num_workers: int = 2,
    prefetch: int = 4,
    shuffle: bool = True,
    seed: int = 0,
    num_epochs: int | None = 1,
) -> OmniLoader:
    """Checkpointable loader over a manifest yielding processed samples, skipping bad files.

    Args:
        manifest: a JSONL manifest path or the items themselves.
        tokenizer: a `Tokenizer`.
        settings: modality settings.
        num_workers: decode threads (media decoders release the GIL). Each processes an image on at
            most ``CPUs // num_workers`` threads (`worker_settings`).
        prefetch: samples decoded ahead of the consumer (bounds memory).
        shuffle: shuffle items per epoch with ``(seed, epoch)``.
        seed: shuffle seed.
        num_epochs: passes before stopping; ``None`` repeats forever.
    """
    source = _ItemSource(load_items(manifest), shuffle, seed, num_epochs)
    return OmniLoader(*assemble_graph(source, tokenizer, settings, num_workers, prefetch))
