"""Task items and dataset records → the model's inputs, through relax-modalities' data paths with the checkpoint's
tokenizer, chat template and processor settings.

This module imports no model stack itself: a :class:`PromptBuilder` can be made and pickled by a process that never
builds a prompt (the driver hands it to the services and the warm-up); the data paths, torch and the checkpoint are
imported where it first builds one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from relax_services.config import ModelConfig

if TYPE_CHECKING:
    from relax_modalities import DataRecord, ProcessorSettings, SampleProcessor
    from relax_modalities.synthetic import TaskItem
    from relax_services.models import Checkpoint, OmniPrompt
    from relax_services.rows import DataItem, HeldoutItem, ItemInfo

__all__ = ["HeldoutReport", "HeldoutSet", "PromptBuilder", "build_heldout", "processor_settings"]


def processor_settings(ckpt: Checkpoint) -> ProcessorSettings:
    """relax-modalities' settings for a checkpoint: its chat template and placeholder ids, and each registered
    modality's settings as its `ModelModality.processor_settings` reads them from the model config and
    ``preprocessor_config.json`` (for the built-in ones: the vision geometry and mel bins of the model config, the
    pixel budget, normalisation and audio framing of the preprocessor config, the processors' defaults where a key
    is absent)."""
    from relax_modalities import ProcessorSettings
    from relax_modalities.text import CheckpointTemplate
    from relax_services.models import MODEL_MODALITIES

    per_modality: dict[str, object] = {}
    for name, modality in MODEL_MODALITIES.items():
        own = modality.processor_settings(ckpt.config, ckpt.preprocessor_for(name))
        if own is not None:
            per_modality[name] = own
    template = CheckpointTemplate.of(ckpt.tokens.placeholders)
    return ProcessorSettings(template=template, modalities=per_modality)


@dataclass
class PromptBuilder:
    """Task item (or its feeder entry) → the model's inputs, through relax-modalities' data paths with the
    checkpoint's tokenizer, chat template and processor settings. Pickles as its model config only (each process
    reads the checkpoint folder once)."""

    model: ModelConfig
    inline_dir: Path | None = None
    """Where a dataset record's inline media bytes are written as files before decoding."""
    _processor: SampleProcessor | None = field(default=None, repr=False, compare=False)
    _ckpt: Checkpoint | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, object]:
        return {"model": self.model, "inline_dir": self.inline_dir, "_processor": None, "_ckpt": None}

    def _ready(self) -> tuple[SampleProcessor, Checkpoint]:
        # Once per process: resolving the default source digests its config and checks its files on every call.
        if self._processor is None or self._ckpt is None:
            from relax_modalities import SampleProcessor
            from relax_services.models import open_checkpoint

            self._ckpt = open_checkpoint(self.model.source, self.model.seed)
            self._processor = SampleProcessor(self._ckpt.tokenizer, processor_settings(self._ckpt))
        return self._processor, self._ckpt

    def __call__(self, item: DataItem | TaskItem) -> OmniPrompt:
        from relax_modalities import DataRecord, MediaError
        from relax_services.models import OmniPrompt, check_placeholders

        processor, ckpt = self._ready()
        task_item: TaskItem | DataRecord = item["item"] if isinstance(item, dict) else item
        if isinstance(task_item, DataRecord):
            try:
                kwargs = processor.process_record(task_item, self.inline_dir)
            except ValueError as exc:  # a chat the template cannot render is this row's fault, like bad media
                if isinstance(exc, MediaError):
                    raise
                raise MediaError(task_item.uid, "manifest", f"chat template: {exc}") from exc
        else:
            kwargs = processor(task_item)
        kwargs.pop("attention_mask")
        kwargs["input_ids"] = kwargs["input_ids"][0]  # [T]
        return check_placeholders(OmniPrompt(**kwargs), ckpt.tokens)


class HeldoutReport(TypedDict):
    """What building a held-out set found: the rows kept (indices into its items, in order) and the rows skipped
    because their media could not be read, by modality and one by one as ``(file, row, reason)``."""

    kept: list[int]
    skipped: dict[str, int]
    bad: list[tuple[str, int, str]]


def build_heldout(
    items: Sequence[DataItem], to_prompt: Callable[[DataItem], OmniPrompt]
) -> tuple[list[HeldoutItem], HeldoutReport]:
    """The held-out prompts of ``items`` (``(task, prompt, its item)``), and the report of what was skipped: a row
    whose media cannot be read is left out and counted, never fatal."""
    from relax_modalities import DataRecord, MediaError

    heldout: list[HeldoutItem] = []
    report: HeldoutReport = {"kept": [], "skipped": {}, "bad": []}
    for index, item in enumerate(items):
        try:
            prompt = to_prompt(item)
        except MediaError as exc:
            report["skipped"][exc.modality] = report["skipped"].get(exc.modality, 0) + 1
            record = item["item"]
            where = (record.source, record.row) if isinstance(record, DataRecord) else (str(item["id"]), index)
            report["bad"].append((where[0], where[1], f"{exc.modality}: {exc.reason}"))
            continue
        info: ItemInfo = {k: v for k, v in item.items() if k != "item"}  # type: ignore[assignment]
        info["media"] = _media_of(item["item"])
        heldout.append((item["task"], prompt, info))
        report["kept"].append(index)
    return heldout, report


def _media_of(item: object) -> list[tuple[str, str | None]]:
    """``(kind, file)`` of a dataset record's or a synthetic item's media, in prompt order (None: inline bytes)."""
    from relax_modalities import DataRecord
    from relax_modalities.synthetic import TaskItem

    if isinstance(item, DataRecord):
        return [(m.kind, m.path) for m in item.media]
    if isinstance(item, TaskItem):
        return [(m.modality, m.path) for m in item.media]
    return []


@dataclass
class HeldoutSet:
    """Held-out rows not yet turned into prompts: the Evaluator builds them in its own process
    (:func:`build_heldout`), so the driver never imports the data paths' model stack.

    Attributes:
        items: The held-out rows as feeder items, in file order.
        to_prompt: Builds each row's prompt.
    """

    items: list[DataItem]
    to_prompt: PromptBuilder

    def build(self) -> tuple[list[HeldoutItem], HeldoutReport]:
        """:func:`build_heldout` of the rows."""
        return build_heldout(self.items, self.to_prompt)
