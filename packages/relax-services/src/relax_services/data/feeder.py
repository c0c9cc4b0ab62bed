"""The prompt feeder: asks the sample queue for admission (the staleness bound paces it), then puts one prompt
row per admitted group into the prompt queue. It keeps the exact ledger of prompt keys.

The items come from one stream (relax-modalities' dataset stream: weighted mixing, checkpointable position, bad
rows skipped and counted); the feeder only sets its task weights. It runs on a thread of the controller; its
position (the stream's, the running rewards, the next key) is part of the run state, so a resumed run continues
with exactly the prompts it would have seen.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypedDict

from relax_modalities import DataRecord, MediaError
from relax_queue import QueueClient, QueueClosedError, QueueFullError, RowInput
from relax_services.config import DataConfig
from relax_services.rows import DataItem, ItemInfo, PromptRow, RecordRow, item_extras

if TYPE_CHECKING:
    from relax_services.models import OmniPrompt

__all__ = ["STREAM_NAME", "FeederState", "ItemStream", "Ledger", "LedgerState", "PromptFeeder"]

STREAM_NAME = "dataset"
"""The stream's key in :class:`FeederState` ``streams`` (checkpoints keep the one-entry mapping they had)."""


class LedgerState(TypedDict):
    """:meth:`Ledger.state_dict`."""

    generated: dict[str, str]
    consumed: dict[str, int]
    requeued: dict[str, str]


class FeederState(TypedDict):
    """:meth:`PromptFeeder.state_dict`: everything a resumed run needs to continue with the same prompts."""

    next_index: int
    streams: dict[str, dict[str, object]]  # STREAM_NAME -> the stream's state_dict()
    running_reward: dict[str, float]  # task -> running held-out reward (drives the adaptive task weights)
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
    """An endless stream of feeder items whose position is checkpointable, mixing its tasks by weights the feeder
    may change (:class:`~relax_services.data.files.RecordStream` over dataset files: the synthetic tasks' or a
    user's)."""

    def next(self) -> DataItem:
        """The next item."""
        ...

    def cache_key(self, item: DataItem) -> str | None:
        """What ``item``'s processed prompt may be cached under across passes (None: not cached)."""
        ...

    def set_task_weights(self, weights: Mapping[str, float], default: float) -> None:
        """Draw tasks by ``weights`` from now on (``default`` for a task not in them)."""
        ...

    def skip(self, item: DataItem, reason: str) -> None:
        """``item`` was skipped (its media could not be read): count it where the stream counts bad items."""
        ...

    def state_dict(self) -> dict[str, object]:
        """The position."""
        ...

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`."""
        ...


class PromptFeeder:
    """Admission-paced producer of prompt rows.

    Args:
        stream: The items (see :class:`ItemStream`).
        to_prompt: Turns an item into the model-ready prompt (the modality data path); None: the rows carry the
            items themselves (:class:`~relax_services.rows.RecordRow`) and the Rollout workers build the prompts,
            reporting a row with unreadable media back (:meth:`mark_skipped`).
        prompt_queue: Queue whose ``rollout`` task the Rollout workers read.
        sample_queue: Queue whose staleness policy grants admissions.
        group_size: Samples per prompt (admissions are taken in whole groups).
        adaptive: Weigh each task by max(1 − its running reward, 0) + ``adaptive_floor`` instead of the stream's own
            mix.
        adaptive_floor: The weight of a solved task (and the offset every task's weight gets), > 0 so that no file
            is ever drawn with weight 0; by default ``data.adaptive_floor``'s.
    """

    def __init__(
        self,
        stream: ItemStream,
        to_prompt: Callable[[DataItem], OmniPrompt] | None,
        prompt_queue: QueueClient,
        sample_queue: QueueClient,
        group_size: int,
        adaptive: bool,
        adaptive_floor: float = DataConfig.model_fields["adaptive_floor"].default,
    ) -> None:
        if not adaptive_floor > 0:
            raise ValueError(f"adaptive_floor must be > 0 (a solved task's weight), got {adaptive_floor}")
        self.stream = stream
        self.to_prompt = to_prompt
        self.prompt_queue = prompt_queue
        self.sample_queue = sample_queue
        self.group_size = group_size
        self.adaptive = adaptive
        self.adaptive_floor = adaptive_floor
        self.next_index = 0
        self.running_reward: dict[str, float] = {}
        self.ledger = Ledger()
        self.skipped: dict[str, int] = {}  # reason -> items skipped because their media could not be read
        self.skipped_items: set[str] = set()
        self._prompts: dict[str, OmniPrompt] = {}  # the stream's cache key -> processed prompt
        self._items: dict[str, DataItem] = {}  # prompt key -> item, until consumed (for requeues)
        self._lock = threading.Lock()
        self._pump_lock = threading.Lock()  # held by a pump in progress, or by pause()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    # ------------------------------------------------------------------ task weights
    def observe(self, reward_by_task: Mapping[str, float], momentum: float = 0.8) -> None:
        """Update the running reward per task (the controller feeds held-out greedy rewards; with ``adaptive``
        they set the stream's task weights, so tasks already solved get fewer prompts). A task not seen before
        starts from 0."""
        with self._lock:
            for task, value in reward_by_task.items():
                previous = self.running_reward.get(task, 0.0)
                self.running_reward[task] = momentum * previous + (1 - momentum) * value
            self._apply_weights()

    def _apply_weights(self) -> None:
        if self.adaptive and self.running_reward:
            # At least the floor (a solved task's weight): a reward above 1 (a user's scale) must not zero a file out.
            floor = self.adaptive_floor
            weights = {t: max(1.0 - r, 0.0) + floor for t, r in self.running_reward.items()}
            self.stream.set_task_weights(weights, default=1.0 + floor)  # a task without a reward yet: as if at 0

    # ------------------------------------------------------------------ producing
    def _put_groups(self, groups: Sequence[tuple[DataItem, str, OmniPrompt | None]]) -> None:
        """Puts ``(item, key, prompt)`` groups as prompt rows (record rows without a prompt builder), in one call
        (one round trip on the Ray queue)."""
        rows = [
            RowInput(
                key, _record_row(item, self.stream.cache_key(item)) if prompt is None else _prompt_row(item, prompt)
            )
            for item, key, prompt in groups
        ]
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
        ready: list[tuple[DataItem, str, OmniPrompt | None]] = []
        for _ in range(groups):
            prompt = None
            for _attempt in range(10_000):
                with self._lock:
                    item = self.stream.next()
                if self.to_prompt is None:  # the Rollout worker builds it
                    break
                prompt = self._process(item)
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

    def _process(self, item: DataItem) -> OmniPrompt | None:
        """The item's prompt, or None (skipped, and counted by the stream with its file, row and reason) when its
        media cannot be read. Prompts are cached under the stream's cache key when it gives one (the rows of small
        files recur every pass, and decoding on the feeder's path would delay every update at τ = 0)."""
        if self.to_prompt is None:
            raise RuntimeError("this feeder has no prompt builder: the Rollout workers build the prompts")
        key = self.stream.cache_key(item)
        cached = None if key is None else self._prompts.get(key)
        if cached is not None:
            return cached
        try:
            prompt = self.to_prompt(item)
        except MediaError as exc:
            with self._lock:
                self._count_skip(item, f"{exc.modality}: {exc.reason}")
            return None
        if key is not None:
            self._prompts[key] = prompt
        return prompt

    def _count_skip(self, item: DataItem, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.skipped_items.add(str(item["id"]))
        self.stream.skip(item, reason)

    def mark_skipped(self, prompt_key: str, reason: str) -> None:
        """A Rollout worker could not read the media of prompt ``prompt_key``'s row (a record row): count it like a
        bad row the feeder met itself (by reason, item and the stream's file and row) and take the key out of the
        ledger, as if it had never been generated. A key already taken out (a restored snapshot delivered the row
        again) changes nothing."""
        with self._lock:
            item = self._items.pop(prompt_key, None)
            if item is None or self.ledger.generated.pop(prompt_key, None) is None:
                return
            self._count_skip(item, reason)

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
            if self.to_prompt is None:
                self._put_groups([(self._items[key], key, None)])
                continue
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
                "streams": {STREAM_NAME: self.stream.state_dict()},
                "running_reward": dict(self.running_reward),
                "ledger": self.ledger.state_dict(),
                "items": dict(self._items),
            }

    def load_state_dict(self, state: FeederState) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: The state holds one stream per task (a checkpoint from before the one data path).
        """
        if STREAM_NAME not in state["streams"]:
            raise ValueError(
                f"the checkpoint's feeder state has per-task streams {sorted(state['streams'])}, not the one "
                "dataset stream this version reads; start the run afresh"
            )
        with self._lock:
            self.next_index = int(state["next_index"])
            self.stream.load_state_dict(state["streams"][STREAM_NAME])
            self.running_reward = dict(state["running_reward"])
            self.ledger.load_state_dict(state["ledger"])
            self._items = dict(state["items"])


def _prompt_row(item: DataItem, prompt: OmniPrompt) -> PromptRow:
    """The prompt queue row of ``item``: its id, task, answer and (for dataset files) data_source, ground truth
    and extra_info (not the loader's record), and the prompt."""
    info: ItemInfo = {"id": item["id"], "task": item["task"], "answer": item["answer"]}
    info.update(item_extras(item))  # type: ignore[typeddict-item]  # the optional keys of both
    if isinstance(item.get("item"), DataRecord):  # a dataset row: its chat prompt as text, for an env's reset
        info["messages"] = [{"role": m.role, "content": m.text} for m in item["item"].messages]
    return {"item": info, "prompt": prompt}


def _record_row(item: DataItem, cache_key: str | None) -> RecordRow:
    """The record row of ``item``: what :func:`_prompt_row` carries about it, the item itself instead of the
    prompt, and the key the worker may cache the built prompt under."""
    info: ItemInfo = {"id": item["id"], "task": item["task"], "answer": item["answer"]}
    info.update(item_extras(item))  # type: ignore[typeddict-item]  # the optional keys of both
    if isinstance(item.get("item"), DataRecord):  # a dataset row: its chat prompt as text, for an env's reset
        info["messages"] = [{"role": m.role, "content": m.text} for m in item["item"].messages]
    return {"item": info, "record": item, "cache_key": cache_key}
