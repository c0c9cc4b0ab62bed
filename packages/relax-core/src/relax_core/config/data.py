"""The dataset-file configs: which files a run reads (:class:`DataFileSpec`) and which of their columns hold
what (:class:`RowSchema`). They live here, beside the other configs, so a run config that names dataset files
loads without the media stack; relax-modalities' readers take them (and re-export them)."""

from __future__ import annotations

import pydantic

from relax_core.config.base import ConfigModel

__all__ = ["DataFileSpec", "RowSchema"]


class RowSchema(ConfigModel):
    """Which columns of a dataset file hold what (defaults are verl's RL parquet names)."""

    prompt_key: str = "prompt"
    """Column of the prompt: a list of chat messages ``{"role", "content"}`` (content a string with a ``<name>``
    marker per media item, ``<image>``/``<video>``/``<audio>`` for the built-in modalities, or a list of typed
    parts), or a plain string (one user turn)."""

    media_keys: dict[str, str] = pydantic.Field(default_factory=dict)
    """Column of each modality's items, by modality name (``data.schema.media_keys.image=pictures``). A modality
    not named here reads the column its data path declares (relax-modalities' ``ModalityPath.column``:
    ``images``, ``videos``, ``audios`` for the built-in three). Items in marker order: paths (relative to the file
    or absolute), bytes, or ``{"bytes": ..., "path": ...}`` dicts as ``datasets`` and verl write them
    (``{"<name>": path, ...}`` also accepted). Names are checked against the registered modalities when the
    files are opened."""

    image_key: str | None = None
    """Column of the prompt's images: the same as ``media_keys.image`` (None: the image path's ``images``)."""

    video_key: str | None = None
    """Column of the prompt's videos: the same as ``media_keys.video`` (None: the video path's ``videos``)."""

    audio_key: str | None = None
    """Column of the prompt's audio clips: the same as ``media_keys.audio`` (None: the audio path's ``audios``)."""

    data_source_key: str = "data_source"
    """Column naming the dataset a row came from; rewards are routed by it."""

    reward_key: str = "reward_model"
    """Column of a mapping holding the ground truth under ``ground_truth_key`` (verl's ``reward_model``)."""

    ground_truth_key: str = "ground_truth"
    """Key of the ground truth inside ``reward_key``."""

    answer_key: str = "answer"
    """Top-level ground-truth column, used when ``reward_key`` is absent from the row."""

    extra_info_key: str = "extra_info"
    """Column of a free-form mapping passed to the reward as metadata."""

    default_data_source: str = ""
    """``data_source`` of rows without one."""

    require_ground_truth: bool = True
    """Rows without a ground truth are bad rows (turn off for rewards that need none, e.g. a reward model)."""

    check_media_files: bool = True
    """Media paths must name existing files, checked when the row is read (a missing one makes a bad row)."""

    @pydantic.model_validator(mode="after")
    def _one_column_per_builtin(self) -> RowSchema:
        """``image_key`` and ``media_keys.image`` (likewise video, audio) may not name two different columns."""
        for name, key in self._named_keys().items():
            other = self.media_keys.get(name)
            if key is not None and other is not None and other != key:
                raise ValueError(f"{name}_key is {key!r} but media_keys.{name} is {other!r}: give one of them")
        return self

    def _named_keys(self) -> dict[str, str | None]:
        # The built-in modalities' own fields, kept so configs that set them keep working.
        return {"image": self.image_key, "video": self.video_key, "audio": self.audio_key}

    def media_key(self, modality: str) -> str | None:
        """The column this schema names for ``modality``'s items (``media_keys``, or the built-in modalities'
        ``<name>_key``); None when it names none and the modality's own column applies."""
        named = self.media_keys.get(modality)
        return named if named is not None else self._named_keys().get(modality)


class DataFileSpec(ConfigModel):
    """One dataset file of a run and its share of the mix."""

    path: str
    """A ``.jsonl``, ``.parquet`` or ``save_to_disk`` folder (relative to the working directory)."""

    weight: float | None = pydantic.Field(default=None, gt=0.0)
    """Relative chance that the next row comes from this file; None weighs the file by its row count, so
    a mix of unweighted files reads every row once per epoch in an even interleaving."""

    format: str = "auto"
    """``auto`` (by suffix), ``jsonl``, ``parquet``, ``hf_disk``, ``hf_json`` or ``hf_parquet``."""
