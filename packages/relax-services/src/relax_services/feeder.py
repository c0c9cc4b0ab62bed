"""The prompt feeder: asks the sample queue for admission (the staleness bound paces it), then puts one prompt
row per admitted group into the prompt queue. It keeps the exact ledger of prompt keys.

It runs on a thread of the controller; its position (task cursors, RNG, next key) is part of the run state, so
a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from relax_modalities import MediaError
from relax_queue import QueueClient, QueueClosedError, QueueFullError, RowInput
from relax_services.rows import DataItem, ItemInfo, PromptRow, item_extras

if TYPE_CHECKING:
    from relax_services.models import OmniPrompt

__all__ = ["FeederState", "ItemStream", "Ledger", "LedgerState", "PromptFeeder", "TaskStream"]


class LedgerState(TypedDict):
    """:meth:`Ledger.state_dict`."""

    generated: dict[str, str]
    consumed: dict[str, int]
    requeued: dict[str, str]


class FeederState(TypedDict):
    """:meth:`PromptFeeder.state_dict`: everything a resumed run needs to continue with the same prompts."""

    next_index: int
    rng: tuple[object, ...]  # random.Random.getstate()
    streams: dict[str, Any]  # stream name -> its state_dict()
    running_reward: dict[str, float]
    ledger: LedgerState
    items: dict[str, DataItem]  # prompt key -> item, for prompts not yet consumed


@dataclass
class Ledger:
    """Exact accounting of prompt keys: every generated key is consumed, requeued (regenerated under a new key)
    or still in flight; none is consumed twice."""

    generated: dict[str, str] = field(default_factory=dict)  # prompt key -> item id
    consumed: dict[str, int] = field(default_factory=dict)  # prompt key -> times consumed
    requeued: dict[str, str] = field(default_factory=dict)  # prompt key -> key it was regenerated as

    def check(self) -> dict[str, int]:
        """Counts, and the violations that must be zero: lost (neither consumed, requeued nor in flight is
        decided by the caller), duplicated (consumed more than once), unknown (consumed but never generated)."""
        duplicated = sum(1 for n in self.consumed.values() if n > 1)
        unknown = sum(1 for k in self.consumed if k not in self.generated)
        pending = [k for k in self.generated if k not in self.consumed and k not in self.requeued]
        return {
            "generated": len(self.generated),
            "consumed": len(self.consumed),
            "requeued": len(self.requeued),
            "in_flight": len(pending),
            "duplicated": duplicated,
            "unknown": unknown,
        }

    def state_dict(self) -> LedgerState:
        """Copies of the three maps."""
        return {"generated": dict(self.generated), "consumed": dict(self.consumed), "requeued": dict(self.requeued)}

    def load_state_dict(self, state: LedgerState) -> None:
        """Restore :meth:`state_dict`."""
        self.generated = dict(state["generated"])
        self.consumed = dict(state["consumed"])
        self.requeued = dict(state["requeued"])


class ItemStream(Protocol):
    """An endless stream of feeder items whose position is checkpointable (:class:`TaskStream` over a task's
    items, or a dataset files' record stream)."""

    cache_prompts: bool
    """Whether the feeder may keep each item's processed prompt for its next epoch (by item id)."""

    def next(self) -> DataItem:
        """The next item."""
        ...

    def skip(self, item: DataItem, reason: str) -> None:
        """``item`` was skipped (its media could not be read): count it where the stream counts bad items."""
        ...

    def state_dict(self) -> object:
        """The position."""
        ...

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict`."""
        ...


class TaskStream:
    """Endless, seeded, reshuffled-per-epoch stream over one task's items; its position is checkpointable."""

    cache_prompts = True  # few items, each seen every epoch

    def __init__(self, items: Sequence[DataItem], seed: int) -> None:
        if not items:
            raise ValueError("a task stream needs at least one item")
        self.items = list(items)
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next(self) -> DataItem:
        """The next item (a new epoch reshuffles)."""
        if self.cursor == len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._shuffle()
        item = self.items[self._order[self.cursor]]
        self.cursor += 1
        return item

    def skip(self, item: DataItem, reason: str) -> None:
        """Nothing to do: the feeder counts skipped task items itself."""

    def state_dict(self) -> dict[str, int]:
        """Epoch and cursor."""
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`state_dict`."""
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self._order = self._shuffle()


class PromptFeeder:
    """Admission-paced producer of prompt rows.

    Args:
        streams: One :class:`ItemStream` per task (a :class:`TaskStream` each), or one over dataset files.
        to_prompt: Turns an item into the model-ready prompt (the modality data path).
        prompt_queue: Queue whose ``rollout`` task the Rollout workers read.
        sample_queue: Queue whose staleness policy grants admissions.
        group_size: Samples per prompt (admissions are taken in whole groups).
        seed: Seed of the task choice.
        adaptive: Choose a task with probability ∝ (1 − its running reward + 0.1) instead of uniformly.
    """

    def __init__(
        self,
        streams: Mapping[str, ItemStream],
        to_prompt: Callable[[DataItem], OmniPrompt],
        prompt_queue: QueueClient,
        sample_queue: QueueClient,
        group_size: int,
        seed: int,
        adaptive: bool,
    ) -> None:
        self.streams = dict(streams)
        self.tasks = sorted(self.streams)
        self.to_prompt = to_prompt
        self.prompt_queue = prompt_queue
        self.sample_queue = sample_queue
        self.group_size = group_size
        self.adaptive = adaptive
        self.rng = random.Random(seed)
        self.next_index = 0
        self.running_reward = {t: 0.0 for t in self.tasks}
        self.ledger = Ledger()
        self.skipped: dict[str, int] = {}  # reason -> items skipped because their media could not be read
        self.skipped_items: set[str] = set()
        self._prompts: dict[str, OmniPrompt] = {}  # item id -> processed prompt
        self._items: dict[str, DataItem] = {}  # prompt key -> item, until consumed (for requeues)
        self._lock = threading.Lock()
        self._pump_lock = threading.Lock()  # held by a pump in progress, or by pause()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    # ------------------------------------------------------------------ task choice
    def observe(self, reward_by_task: Mapping[str, float], momentum: float = 0.8) -> None:
        """Update the running reward per task (the controller feeds held-out greedy rewards; they drive the
        adaptive task weights, so tasks already solved get fewer prompts)."""
        with self._lock:
            for task, value in reward_by_task.items():
                if task in self.running_reward:
                    self.running_reward[task] = momentum * self.running_reward[task] + (1 - momentum) * value

    def _choose_task(self) -> str:
        if not self.adaptive:
            return self.rng.choice(self.tasks)
        weights = [1.0 - self.running_reward[t] + 0.1 for t in self.tasks]
        return self.rng.choices(self.tasks, weights=weights)[0]

    # ------------------------------------------------------------------ producing
    def _put_groups(self, groups: Sequence[tuple[DataItem, str, OmniPrompt]]) -> None:
        """Puts ``(item, key, prompt)`` groups as prompt rows, in one call (one round trip on the Ray queue)."""
        rows = [RowInput(key, _prompt_row(item, prompt)) for item, key, prompt in groups]
        while rows:  # the prompt queue is bounded: wait for room, but stay stoppable
            try:
                self.prompt_queue.put_many(rows, timeout=1.0)
                return
            except QueueFullError:  # puts are idempotent per key: putting the rows again re-puts none twice
                if self._stop.is_set():
                    raise

    def pump(self, max_groups: int = 64, timeout: float = 0.2) -> int:
        """Admit and put up to ``max_groups`` prompt groups; returns how many were put.

        Only as many groups are admitted as the prompt queue has room for (this feeder is its only producer), so a
        pump never blocks on a full queue and a checkpoint never waits long for the feeder to pause.
        """
        self._regenerate_requeued()
        room = self._prompt_room()
        if room <= 0:
            return 0
        granted: int = self.sample_queue.admit(self.group_size * min(max_groups, room), timeout=timeout)
        groups, spare = divmod(granted, self.group_size)
        if spare:
            self.sample_queue.release_admission(spare)
        ready: list[tuple[DataItem, str, OmniPrompt]] = []
        for _ in range(groups):
            prompt = None
            for _attempt in range(10_000):
                with self._lock:
                    task = self._choose_task()
                    item = self.streams[task].next()
                prompt = self._process(item, self.streams[task])
                if prompt is not None:
                    break
            else:
                raise RuntimeError(f"no readable training item left: skipped {self.skipped}")
            with self._lock:
                key = f"p{self.next_index:07d}"
                self.next_index += 1
                self.ledger.generated[key] = str(item["id"])
                self._items[key] = item
            ready.append((item, key, prompt))
        self._put_groups(ready)
        return groups

    def _process(self, item: DataItem, stream: ItemStream | None = None) -> OmniPrompt | None:
        """The item's prompt, or None (skipped and counted) when its media cannot be read. Task prompts are cached
        by item id: items recur every epoch, and decoding on the feeder's path would delay every update at τ = 0.
        A stream without ``cache_prompts`` (dataset files: many rows) is processed every time."""
        cached = self._prompts.get(str(item["id"]))
        if cached is not None:
            return cached
        try:
            prompt = self.to_prompt(item)
            if stream is not None and stream.cache_prompts:
                self._prompts[str(item["id"])] = prompt
            return prompt
        except MediaError as exc:
            with self._lock:
                reason = f"{exc.modality}: {exc.reason}"
                self.skipped[reason] = self.skipped.get(reason, 0) + 1
                self.skipped_items.add(str(item["id"]))
                if stream is not None:
                    stream.skip(item, reason)
            return None

    def _prompt_room(self) -> int:
        metrics = self.prompt_queue.metrics()
        capacity = metrics["max_rows"]
        return 1 << 30 if capacity is None else int(capacity) - int(metrics["depth_rows"])

    def _regenerate_requeued(self) -> None:
        for row in self.sample_queue.take_requeued():
            old = str(row.group_id)
            if old in self.ledger.requeued or old not in self._items:
                continue  # a group is requeued once per stale sample row; regenerate it once
            granted: int = self.sample_queue.admit(self.group_size, timeout=5.0)
            if granted < self.group_size:
                self.sample_queue.release_admission(granted)
                return
            with self._lock:
                key = f"p{self.next_index:07d}"
                self.next_index += 1
                self.ledger.requeued[old] = key
                self.ledger.generated[key] = self.ledger.generated[old]
                self._items[key] = self._items[old]
            prompt = self._process(self._items[key])
            if prompt is not None:  # media that read before but fail now: skipped and counted, like any bad file
                self._put_groups([(self._items[key], key, prompt)])

    def mark_consumed(self, prompt_keys: Sequence[str]) -> None:
        """Count each prompt key as consumed once more (the trainer acked its group) and forget its item."""
        with self._lock:
            for key in prompt_keys:
                self.ledger.consumed[key] = self.ledger.consumed.get(key, 0) + 1
                self._items.pop(key, None)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        """Start the feeder thread, which pumps until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="prompt-feeder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._pump_lock:
                    put = self.pump()
                if put == 0:
                    self._stop.wait(0.05)
        except (QueueClosedError, QueueFullError) as exc:
            if not self._stop.is_set():
                self.error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # surfaced by the controller, which stops the run with this reason
            self.error = f"{type(exc).__name__}: {exc}"

    def pause(self) -> None:
        """Wait for the pump in progress to finish and hold the feeder (for a consistent checkpoint)."""
        self._pump_lock.acquire()

    def resume(self) -> None:
        """Release a :meth:`pause`."""
        self._pump_lock.release()

    def stop(self) -> None:
        """Stop the feeder thread (waits up to 10 s for the pump in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> FeederState:
        """The feeder's position (see :class:`FeederState`)."""
        with self._lock:
            return {
                "next_index": self.next_index,
                "rng": self.rng.getstate(),
                "streams": {t: s.state_dict() for t, s in self.streams.items()},
                "running_reward": dict(self.running_reward),
                "ledger": self.ledger.state_dict(),
                "items": dict(self._items),
            }

    def load_state_dict(self, state: FeederState) -> None:
        """Restore :meth:`state_dict`."""
        with self._lock:
            self.next_index = int(state["next_index"])
            self.rng.setstate(state["rng"])
            for task, s in state["streams"].items():
                self.streams[task].load_state_dict(s)
            self.running_reward = dict(state["running_reward"])
            self.ledger.load_state_dict(state["ledger"])
            self._items = dict(state["items"])


def _prompt_row(item: DataItem, prompt: OmniPrompt) -> PromptRow:
    """The prompt queue row of ``item``: its id, task, answer and (for dataset files) data_source, ground truth
    and extra_info (not the loader's record), and the prompt."""
    info: ItemInfo = {"id": item["id"], "task": item["task"], "answer": item["answer"]}
    info.update(item_extras(item))  # type: ignore[typeddict-item]  # the optional keys of both
    return {"item": info, "prompt": prompt}
