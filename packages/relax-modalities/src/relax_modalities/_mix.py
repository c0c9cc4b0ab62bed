"""Task-weighted sampling: an endless stream that draws each sample's task by adjustable weights.

The DESIGN field notes found per-task weights decisive when all tasks train together (sampling a
task with probability ∝ 1 − its running reward + 0.1 brought every task up). The trainer computes
the weights; this source draws by them, reproducibly and checkpointably.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from relax_modalities._loader import OmniLoader, ProcessedSample, _SkipBad, assemble_graph, load_items
from relax_modalities._sample import ProcessorSettings
from relax_modalities.synthetic._manifest import TaskItem
from relax_modalities.text import Tokenizer


class TaskMixSource(BaseNode[TaskItem]):  # type: ignore[misc]  # torchdata ships no type hints
    """Endless items: the task is drawn by weight, then the task's next item in its own shuffled order.

    Each task's items are reshuffled per pass with ``(seed, task index, pass)``; the task draws come
    from one seeded generator. State = generator state, every task's pass and position, the weights.

    Args:
        items: all items; their ``task`` fields define the tasks.
        weights: task → non-negative weight (missing tasks get 0); at least one positive.
        seed: seed of the shuffles and the task draws.
    """

    def __init__(self, items: Sequence[TaskItem], weights: Mapping[str, float], seed: int = 0) -> None:
        super().__init__()
        self.tasks: list[str] = list(dict.fromkeys(it.task for it in items))
        if not self.tasks:
            raise ValueError("the task mix needs at least one item")
        self.by_task = {t: [it for it in items if it.task == t] for t in self.tasks}
        self.seed = seed
        self._weights = self._check(weights)
        self._rng = np.random.default_rng(seed)
        self._passes = dict.fromkeys(self.tasks, 0)
        self._pos = dict.fromkeys(self.tasks, 0)
        self._orders: dict[str, np.ndarray] = {}

    def _check(self, weights: Mapping[str, float]) -> np.ndarray:
        unknown = sorted(set(weights) - set(self.tasks))
        if unknown:
            raise ValueError(f"task weights name unknown tasks {unknown}; tasks are {self.tasks}")
        w = np.array([float(weights.get(t, 0.0)) for t in self.tasks])
        if (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
            raise ValueError(f"task weights must be finite, >= 0 and not all 0, got {dict(weights)}")
        normalised: np.ndarray = w / w.sum()
        return normalised

    @property
    def weights(self) -> dict[str, float]:
        """Current normalised weights."""
        return {t: float(w) for t, w in zip(self.tasks, self._weights, strict=True)}

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Replace the weights; draws made after this call use them."""
        self._weights = self._check(weights)

    def _order(self, task: str) -> np.ndarray:
        key = (self.seed, self.tasks.index(task), self._passes[task])
        return np.random.default_rng(key).permutation(len(self.by_task[task]))

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self._rng.bit_generator.state = initial_state["rng"]
            self._passes = {t: int(initial_state["passes"][t]) for t in self.tasks}
            self._pos = {t: int(initial_state["pos"][t]) for t in self.tasks}
            self._weights = self._check(initial_state["weights"])
        self._orders = {t: self._order(t) for t in self.tasks}

    def next(self) -> TaskItem:
        task = self.tasks[int(self._rng.choice(len(self.tasks), p=self._weights))]
        if self._pos[task] >= len(self.by_task[task]):
            self._passes[task] += 1
            self._pos[task] = 0
            self._orders[task] = self._order(task)
        item = self.by_task[task][int(self._orders[task][self._pos[task]])]
        self._pos[task] += 1
        return item

    def get_state(self) -> dict[str, Any]:
        return {
            "rng": self._rng.bit_generator.state,
            "passes": dict(self._passes),
            "pos": dict(self._pos),
            "weights": self.weights,
        }


class TaskMixLoader(OmniLoader):
    """An `OmniLoader` over a `TaskMixSource` whose weights can be changed while it runs.

    A change reaches the consumer after the samples already decoded ahead (``prefetch`` plus the
    workers' queue). Resume is exact when the weights did not change between the snapshot and the
    draws that were already prefetched at that time.
    """

    def __init__(self, root: BaseNode[ProcessedSample], skip: _SkipBad, source: TaskMixSource) -> None:
        super().__init__(root, skip)
        self.source = source

    def set_task_weights(self, weights: Mapping[str, float]) -> None:
        """Set task → weight (normalised; unknown tasks raise ``ValueError``)."""
        self.source.set_weights(weights)

    @property
    def task_weights(self) -> dict[str, float]:
        """Current normalised weights."""
        return self.source.weights


def build_task_mix_loader(
    manifest: str | os.PathLike[str] | Sequence[TaskItem],
    tokenizer: Tokenizer,
    task_weights: Mapping[str, float] | None = None,
    settings: ProcessorSettings | None = None,
    *,
    num_workers: int = 2,
    prefetch: int = 4,
    seed: int = 0,
) -> TaskMixLoader:
    """Endless checkpointable loader drawing each sample's task by ``task_weights`` (uniform if None).

    Args:
        manifest: a JSONL manifest path or the items themselves.
        tokenizer: a `Tokenizer`.
        task_weights: task → weight; change it later with `TaskMixLoader.set_task_weights`.
        settings: modality settings.
        num_workers: decode threads, each processing an image on at most ``CPUs // num_workers`` threads.
        prefetch: samples decoded ahead of the consumer.
        seed: seed of the shuffles and task draws.
    """
    items = load_items(manifest)
    weights = task_weights if task_weights is not None else {t: 1.0 for t in dict.fromkeys(i.task for i in items)}
    source = TaskMixSource(items, weights, seed)
    return TaskMixLoader(*assemble_graph(source, tokenizer, settings, num_workers, prefetch), source)
