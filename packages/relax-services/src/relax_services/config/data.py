"""The run config's model and data sections: which policy checkpoint to train (``model``) and on what
(``data``: the user's dataset files, or the synthetic omni tasks). Exported by :mod:`relax_services.config`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pydantic

from relax_core import ConfigModel, DataFileSpec, RowSchema

__all__ = ["DEFAULT_MODEL_SOURCE", "DEFAULT_TASKS", "DataConfig", "LoraConfig", "ModelConfig", "TaskName"]

TaskName = Literal["image", "audio", "video", "text", "audio_video"]
DEFAULT_TASKS: tuple[TaskName, ...] = ("image", "audio", "video", "text")


DEFAULT_MODEL_SOURCE = "tiny-omni"
"""``model.source`` of the default run: the tiny omni thinker's checkpoint, written once into the cache."""


class LoraConfig(ConfigModel):
    """Low-rank adapters (LoRA, Hu et al. 2021) on the policy, through peft: each target linear layer ``W`` of shape
    ``[out, in]`` trains as ``W + (alpha / rank) · B A`` with ``A`` ``[rank, in]`` and ``B`` ``[out, rank]``
    (``B`` starts at zero, so the run starts from the checkpoint's weights); ``W`` stays frozen."""

    rank: int = pydantic.Field(default=8, ge=1)
    """Inner dimension ``r`` of ``B A``."""

    alpha: int = pydantic.Field(default=16, ge=1)
    """Scale numerator: the update is ``(alpha / rank) · B A`` (an integer, as peft's ``lora_alpha``)."""

    dropout: float = pydantic.Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training (none while scoring). Drawn from the trainer's seeded RNG,
    which checkpoints hold, so a resumed run draws the same masks."""

    target_modules: list[str] = pydantic.Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Names of the linear layers that get adapters: every ``nn.Linear`` whose own name (the last part of its
    dotted path) is listed, in the text decoder and, where they share a name, in the media encoders (the default
    also reaches the audio encoder's ``q_proj``/``k_proj``/``v_proj``). A name the model has no linear layer of is
    refused when the trainer builds its engine, with the names the model has."""


class ModelConfig(ConfigModel):
    """Which policy model to train."""

    source: str = DEFAULT_MODEL_SOURCE
    """A local Hugging Face checkpoint folder (config.json, weights, tokenizer with its chat template, optional
    preprocessor_config.json) of a supported family (``relax_services.models.FAMILIES``). 'tiny-omni' is the
    default ≈0.4 M-parameter Qwen2.5-Omni thinker: a folder written once under ``$RELAX_CACHE_DIR`` (default
    ``~/.cache/relax``) from a config and a locally built tokenizer, then read like any other."""

    seed: int = 0
    """Seed of the initial weights of the 'tiny-omni' folder (ignored for other sources)."""

    export_hf: bool = True
    """Also write each checkpoint's policy (and critic) in Hugging Face format, in its ``hf`` folder (weights as
    safetensors, plus the model folder's tokenizer and processor files); ``relax export`` does it afterwards."""

    lora: LoraConfig | None = None
    """Train low-rank adapters instead of every weight (``model.lora.rank=16``, or ``model.lora={}`` for the
    defaults); None: full fine-tuning. The Trainer optimises the adapters only; rollout engines and the Reference
    receive merged weights under the model's own names; checkpoints hold the adapters; the Hugging Face export
    writes the merged model and the adapter in peft's format (``hf/adapter``). The single-process trainer, or the
    FSDP2 group data-parallel (``trainer.tensor_parallel`` and ``trainer.sequence_parallel`` 1); the critic and the
    format warm-up train every weight.
    """


class DataConfig(ConfigModel):
    """The training data: the user's dataset files (``train_files``), or by default the synthetic omni tasks,
    written as dataset files of the same schema (one per task, weighted evenly) and read the same way."""

    # `schema` is the YAML name of `schema_` (pydantic's BaseModel has a `schema` attribute of its own).
    model_config = pydantic.ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    train_files: list[DataFileSpec] = pydantic.Field(default_factory=list)
    """Dataset files to train on (JSONL, Parquet or a ``datasets`` folder in verl's RL schema, see ``schema``),
    each a path or ``{path, weight, format}``; ``data.train_files=a.parquet`` on the command line. Empty: the
    synthetic tasks below. Streamed endlessly, each file reshuffled every pass."""

    eval_files: list[DataFileSpec] = pydantic.Field(default_factory=list)
    """Held-out files (same forms), evaluated greedily per ``data_source``; empty with ``train_files`` given:
    no held-out evaluation."""

    schema_: RowSchema = pydantic.Field(default_factory=RowSchema, alias="schema")
    """Column names and row rules of the dataset files (``data.schema.prompt_key=question``, ...)."""

    shuffle_buffer: int = pydantic.Field(default=1024, ge=0)
    """Rows held for shuffling the training files (0 or 1: file order)."""

    tasks: list[TaskName] = pydantic.Field(default_factory=lambda: list(DEFAULT_TASKS))
    """Tasks to train on; each is one modality path (audio_video combines two)."""

    train_per_task: int = pydantic.Field(default=256, ge=1)
    """Training prompts written per task."""

    eval_per_task: int = pydantic.Field(default=32, ge=1)
    """Held-out prompts per task, never trained on."""

    difficulty: int = pydantic.Field(default=0, ge=0)
    """Task difficulty level passed to the synthetic task generator."""

    seed: int = 0
    """Seed of the synthetic data and of the prompt order (the dataset files' mixing and shuffling too)."""

    @pydantic.field_validator("train_files", "eval_files", mode="before")
    @classmethod
    def _paths_as_specs(cls, value: object) -> object:
        """A path, or a list of paths and ``{path, weight, format}`` mappings (what an override gives)."""
        if isinstance(value, str | Path):
            value = [value]
        if isinstance(value, list):
            return [{"path": str(v)} if isinstance(v, str | Path) else v for v in value]
        return value

    adaptive_weights: bool = True
    """Weigh each training file by max(1 − the latest held-out reward of its rows' data_source, 0) +
    ``adaptive_floor``, so lagging tasks get more prompts (the files' own weights when off)."""

    adaptive_floor: float = pydantic.Field(default=0.03, gt=0.0, le=1.0)
    """A solved task's weight under ``adaptive_weights`` (every task's weight is offset by it). Lower gives a
    lagging task a larger share once the others are solved, at the cost of fewer prompts rehearsing them: with
    three solved tasks and one at 0.5, 0.1 gives the lagging one 67 % of the prompts, 0.03 gives it 85 %."""

    data_dir: Path | None = None
    """An existing folder where the synthetic tasks' dataset files (one training and one held-out JSONL per task,
    media beside them) are written once and reused. Default: ``$RELAX_CACHE_DIR/datasets`` (the default model's
    cache, ``~/.cache/relax``)."""
