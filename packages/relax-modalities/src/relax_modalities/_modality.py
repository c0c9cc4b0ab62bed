"""The modality seam: what one modality owns, behind one Protocol, and the explicit registry of modalities.

A modality's path from a file to the model's inputs is one `ModalityPath`: it decodes and processes a file
(`ModalityPath.process`, which also says how many placeholder tokens the item takes, as a `MediaSlot`), turns one
prompt's processed items into the forward kwargs it owns (`ModalityPath.model_inputs`), packs several prompts'
kwargs into a batch without padding what need not be padded (`ModalityPath.pack`) and prices a prompt's items for
cost-aware batching (`ModalityPath.cost`). The chat layer renders each slot as its placeholder span: with a
checkpoint template the placeholder id is the checkpoint's ``<name>`` role; with the plain-string template the
span strings are the template's (`ChatTemplate.spans`).

A path also declares what the rest of the data layer derives from the registry: its settings
(`ModalityPath.default_settings`, the defaults of its entry in `ProcessorSettings`, given as
``ProcessorSettings(<name>=...)``) and its dataset column (`ModalityPath.column`, the default column of its items
in the row schema; its marker in prompt text is ``<name>``).

`MODALITY_PATHS` maps a modality's name (the ``modality`` of a `MediaRef` and of a `MediaSlot`) to its path, in
the order the forward kwargs are laid out. Adding a modality is one module with its path plus one entry here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from relax_modalities._media import MediaBundle, PackedMedia
from relax_modalities._paths import AUDIO, IMAGE, VIDEO

if TYPE_CHECKING:
    from relax_modalities._sample import ProcessorSettings
    from relax_modalities.synthetic._manifest import MediaRef

__all__ = [
    "MODALITY_PATHS",
    "MediaBundle",
    "ModalityPath",
    "PackedMedia",
    "bundle_inputs",
    "modality_path",
    "modality_table",
]


class ModalityPath(Protocol):
    """What one modality owns between a file and the model's forward kwargs.

    Attributes:
        name: the modality's name: the ``modality`` of the `MediaRef`s and `MediaSlot`s it handles, the role
            of its placeholder id in a `CheckpointTemplate`, its keyword in `ProcessorSettings` and its ``<name>``
            marker in a dataset row's prompt text.
        keys: the forward kwargs it produces, in order.
    """

    name: str
    keys: tuple[str, ...]

    @property
    def column(self) -> str:
        """The dataset column of its items when the row schema names none (``RowSchema.media_keys``)."""
        ...

    @property
    def default_settings(self) -> object:
        """Its default settings: an immutable (frozen dataclass) value; `ProcessorSettings` holds one of this type
        per registered modality and `process` reads it with `ProcessorSettings.of`."""
        ...

    def process(self, ref: MediaRef, settings: ProcessorSettings, media: MediaBundle) -> None:
        """Loads, decodes and processes one file; appends its item(s) (`MediaBundle.add`) and slot(s).

        Raises:
            MediaError: the file cannot be turned into model input (any other exception is wrapped into one
                naming the file by the sample processor).
        """
        ...

    def model_inputs(self, items: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The forward kwargs of one prompt's items of this modality (at least one item)."""
        ...

    def pack(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> PackedMedia:
        """Packs the kwargs of several prompts (as `model_inputs` gave them; prompts without this modality
        included) into one batch's."""
        ...

    def cost(self, sample: Mapping[str, torch.Tensor]) -> float:
        """The encoder's share of one prompt's compute cost (0 when it has no item of this modality)."""
        ...


MODALITY_PATHS: dict[str, ModalityPath] = {
    "image": IMAGE,
    "video": VIDEO,
    "audio": AUDIO,
}
"""Modality name → its path, in the order of the forward kwargs. One entry per modality."""


def modality_path(name: str, where: str = "") -> ModalityPath:
    """The registered path of modality ``name``.

    Raises:
        KeyError: naming the modality, ``where`` it came from and the registered ones.
    """
    try:
        return MODALITY_PATHS[name]
    except KeyError:
        at = f" ({where})" if where else ""
        raise KeyError(f"unknown media modality {name!r}{at}; registered: {', '.join(MODALITY_PATHS)}") from None


def bundle_inputs(media: MediaBundle, input_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """The forward kwargs of one prompt: ``input_ids`` / ``attention_mask`` ``[1, T]``, then each registered
    modality's kwargs (in registry order) when the prompt has items of it."""
    ids = torch.tensor([list(input_ids)], dtype=torch.long)  # [1, T]
    out: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for name, path in MODALITY_PATHS.items():
        items = media.items.get(name)
        if items:
            out.update(path.model_inputs(items))
    return out


def modality_table() -> str:
    """The registered modalities as the Markdown table docs/modalities.md shows (docs derived from the registry:
    a test compares the two): name, default dataset column, prompt marker, settings type, forward kwargs."""
    lines = [
        "| modality | dataset column (default) | prompt marker | settings (`ProcessorSettings(<name>=...)`) "
        "| forward kwargs |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, path in MODALITY_PATHS.items():
        kwargs = ", ".join(f"`{k}`" for k in path.keys)
        settings = type(path.default_settings).__name__
        lines.append(f"| `{name}` | `{path.column}` | `<{name}>` | `{settings}` | {kwargs} |")
    return "\n".join(lines)
