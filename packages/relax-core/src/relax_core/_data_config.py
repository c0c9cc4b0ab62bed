"""The dataset-file configs: which files a run reads (:class:`DataFileSpec`) and which of their columns hold
what (:class:`RowSchema`). They live here, beside the other configs, so a run config that names dataset files
loads without the media stack; relax-modalities' readers take them (and re-export them)."""

from __future__ import annotations

import pydantic

from relax_core._config_base import ConfigModel

__all__ = ["DataFileSpec", "RowSchema"]


class RowSchema(ConfigModel):
    """Which columns of a dataset file hold what (defaults are verl's RL parquet names)."""

    prompt_key: str = "prompt"
    """Column of the prompt: a list of chat messages ``{"role", "content"}`` (content a string with
    ``<image>``/``<video>``/``<audio>`` markers, or a list of typed parts), or a plain string (one user turn)."""

    image_key: str = "images"
    """Column of the prompt's images, in marker order: paths (relative to the file or absolute), bytes, or
    ``{"bytes": ..., "path": ...}`` dicts as ``datasets`` and verl write them."""

    video_key: str = "videos"
    """Column of the prompt's videos (same forms as images; ``{"video": path, ...}`` also accepted)."""

    audio_key: str = "audios"
    """Column of the prompt's audio clips (same forms as images; ``{"audio": path}`` also accepted)."""

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


class DataFileSpec(ConfigModel):
    """One dataset file of a run and its share of the mix."""

    path: str
    """A ``.jsonl``, ``.parquet`` or ``save_to_disk`` folder (relative to the working directory)."""

    weight: float | None = pydantic.Field(default=None, gt=0.0)
    """Relative chance that the next row comes from this file; None weighs the file by its row count, so
    a mix of unweighted files reads every row once per epoch in an even interleaving."""

    format: str = "auto"
    """``auto`` (by suffix), ``jsonl``, ``parquet``, ``hf_disk``, ``hf_json`` or ``hf_parquet``."""
