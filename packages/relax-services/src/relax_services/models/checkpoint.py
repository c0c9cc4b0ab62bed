"""Local Hugging Face checkpoint folders: validation, the tokenizer and ids they carry, and model loading.

Every model a run trains — the default tiny thinker included — is a folder in Hugging Face format: ``config.json``
(whose ``architectures`` names the family, see :mod:`~relax_services.models.families`), weights, tokenizer files
with a chat template, ``generation_config.json`` and, for media families, ``preprocessor_config.json``.
:func:`validate_checkpoint` checks a folder without allocating any weight, so a bad ``model.source`` fails before
a service starts.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from relax_services.models._light import CheckpointError, CheckpointNotFoundError  # light: the driver raises them
from relax_services.models.families import CONTAINERS, ModelFamily, family_of
from relax_services.models.modalities import MODEL_MODALITIES
from relax_services.models.tokens import TokenIds, token_ids_from

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_SOURCE",
    "Checkpoint",
    "CheckpointError",
    "CheckpointNotFoundError",
    "copy_side_files",
    "load_model",
    "open_checkpoint",
    "resolve_source",
    "validate_checkpoint",
]

DEFAULT_SOURCE = "tiny-omni"
"""``model.source`` of the default model: the tiny thinker's cache folder (written on first use)."""

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint folder and what it carries (no weights).

    Attributes:
        path: The folder.
        family: Its model family.
        config: The transformers model config.
        tokenizer: The tokenizer (``AutoTokenizer``), with its chat template when it has one.
        tokens: Every id the engines and data paths use.
        preprocessor: ``preprocessor_config.json`` as a dict (empty when absent).
        video_preprocessor: ``video_preprocessor_config.json`` as a dict (empty when absent; Qwen3-VL's checkpoints
            ship their video processor's settings there, apart from the image processor's).
    """

    path: Path
    family: ModelFamily
    config: Any
    tokenizer: Any
    tokens: TokenIds
    preprocessor: dict[str, Any]
    video_preprocessor: dict[str, Any] = field(default_factory=dict)

    def preprocessor_for(self, modality: str) -> Mapping[str, object]:
        """The processor settings a modality's data path reads: ``video_preprocessor_config.json`` for video when
        the folder has one (as transformers' ``AutoVideoProcessor`` prefers it), else ``preprocessor_config.json``."""
        return self.video_preprocessor if modality == "video" and self.video_preprocessor else self.preprocessor

    def load_model(self, dtype: torch.dtype = torch.float32) -> Any:
        """The model, through its family's transformers class, in eval mode."""
        return load_model(self.path, dtype)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template (else prompts are rendered as plain text)."""
        return bool(getattr(self.tokenizer, "chat_template", None))


def resolve_source(source: str | Path, seed: int = 0) -> Path:
    """The folder of ``model.source``: ``"tiny-omni"`` is the default checkpoint (written once), else a path."""
    if str(source) == DEFAULT_SOURCE:
        from relax_services.models.tiny_omni import tiny_omni_checkpoint

        return tiny_omni_checkpoint(seed)
    return Path(source).expanduser().resolve()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _check_sizes(path: Path, family: ModelFamily, config: PretrainedConfig) -> None:
    text = getattr(config, "text_config", None) or config
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    if hidden <= 0 or heads <= 0 or heads % kv:
        raise CheckpointError(
            f"{path}: text config sizes are inconsistent (hidden_size {hidden}, heads {heads}, kv heads {kv})"
        )
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    if family.positions != "1d":
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        section = rope.get("mrope_section") if isinstance(rope, dict) else None
        if section is not None and sum(section) != head_dim // 2:
            raise CheckpointError(f"{path}: mrope_section {list(section)} must sum to head_dim / 2 = {head_dim // 2}")


def _placeholder_keys(family: ModelFamily) -> tuple[tuple[str, str], ...]:
    """The family's placeholder keys, then each registered modality's (`ModelModality.token_attr`) that the family
    does not name: a checkpoint whose config carries a new modality's placeholder id gets it without a table edit
    (a key absent from the config is skipped)."""
    named = {role for role, _ in family.placeholder_keys}
    extra = tuple((m.name, m.token_attr) for m in MODEL_MODALITIES.values() if m.name not in named)
    return family.placeholder_keys + extra


_PIPELINE_PARTS = ("normalizer", "pre_tokenizer", "decoder")  # with the model's type: how text becomes ids


def _as_in_file(path: Path, tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """``tokenizer`` (``AutoTokenizer``'s), or the folder's ``tokenizer.json`` as written where the two differ.

    transformers 5 maps a ``model_type`` to its tokenizer class (``qwen2`` → ``Qwen2Tokenizer``), and such a class
    builds its own normaliser, pre-tokeniser and decoder over the file's vocabulary. For the published checkpoints
    these are the file's own, but a checkpoint with another tokenizer under that model type is then cut other than
    its file says: relax's tiny Qwen2 checkpoint (a 64-id character vocabulary with ``user`` and ``assistant`` as
    one id each) lost every newline and spelled the role words letter by letter, 20 prompt ids for the 12 of its
    chat template, which every other reader of the folder (TRL, vLLM) tokenizes as written."""
    file = path / "tokenizer.json"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not file.is_file() or backend is None:
        return tokenizer
    written, loaded = _read_json(file), json.loads(backend.to_str())

    def pipeline(spec: Mapping[str, object]) -> list[object]:
        model = spec.get("model")
        return [spec.get(k) for k in _PIPELINE_PARTS] + [model.get("type") if isinstance(model, dict) else None]

    if pipeline(written) == pipeline(loaded):
        return tokenizer
    from transformers import TokenizersBackend

    faithful: PreTrainedTokenizerBase = TokenizersBackend.from_pretrained(path, local_files_only=True)
    if not getattr(faithful, "chat_template", None):
        faithful.chat_template = getattr(tokenizer, "chat_template", None)
    return faithful


def _processor_chat_template(path: Path) -> str | None:
    """The chat template of the folder's processor files (``chat_template.jinja``, else the older
    ``chat_template.json``), which transformers' processors read and its tokenizers do not: the published Qwen-VL
    and Qwen-Omni checkpoints ship their template there."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    legacy = path / "chat_template.json"
    if not legacy.is_file():
        return None
    template = _read_json(legacy).get("chat_template")
    if not isinstance(template, str):
        raise CheckpointError(f"{legacy}: expected a 'chat_template' string")
    return template


def validate_checkpoint(path: str | Path) -> Checkpoint:
    """Checks a checkpoint folder and reads its config, tokenizer and ids; allocates no weight.

    A whole published model that holds a family's model as a part (:data:`~relax_services.models.families.
    CONTAINERS`: Qwen2.5-Omni, whose thinker relax trains) is read as that part: its sub-config, its weights.

    Checked: the folder exists and has ``config.json`` with a supported ``architectures`` entry, weight files and
    tokenizer files (a tokenizer without a chat template takes the processor's, :func:`_processor_chat_template`);
    the tokenizer's ids, the eos, pad and every media placeholder fit the model's vocabulary; the text sizes are
    consistent (heads divide the width; the multimodal rope sections sum to half the head dim).

    Raises:
        CheckpointError: naming the path and what is missing or wrong.
        UnsupportedArchitectureError: for an architecture outside :data:`~relax_services.models.families.FAMILIES`.
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"model checkpoint {path} does not exist or is not a folder (no config.json)")
    raw = _read_json(path / "config.json") if (path / "config.json").is_file() else None
    if raw is None:
        raise CheckpointNotFoundError(f"{path} is not a Hugging Face checkpoint folder: no config.json")
    architectures = raw.get("architectures") or []
    if not architectures:
        raise CheckpointError(f"{path / 'config.json'} names no architecture ('architectures' is empty)")
    family = family_of(str(architectures[0]), where=str(path / "config.json"))
    if not any((path / name).is_file() for name in _WEIGHT_FILES):
        raise CheckpointError(f"{path}: no weights (expected one of {', '.join(_WEIGHT_FILES)})")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise CheckpointError(f"{path}: no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if (container := CONTAINERS.get(str(architectures[0]))) is not None:
        # Checked in the file: transformers fills a missing part config with the full-size model's defaults.
        if not isinstance(raw.get(container.config_key), dict):
            raise CheckpointError(f"{path / 'config.json'}: {architectures[0]} without {container.config_key!r}")
        config = getattr(config, container.config_key)
    _check_sizes(path, family, config)
    try:
        tokenizer = _as_in_file(path, AutoTokenizer.from_pretrained(path, local_files_only=True))
    except Exception as exc:  # transformers raises several types for unreadable tokenizer files
        raise CheckpointError(f"{path}: the tokenizer cannot be loaded ({type(exc).__name__}: {exc})") from exc
    if not getattr(tokenizer, "chat_template", None) and (template := _processor_chat_template(path)) is not None:
        tokenizer.chat_template = template
    try:
        generation = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:  # no generation_config.json: the model config's ids stand in
        generation = GenerationConfig.from_model_config(getattr(config, "text_config", None) or config)
    try:
        tokens = token_ids_from(tokenizer, config, generation, _placeholder_keys(family))
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if len(tokenizer) > tokens.vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only {tokens.vocab_size}"
        )
    preprocessor_file = path / "preprocessor_config.json"
    preprocessor = _read_json(preprocessor_file) if preprocessor_file.is_file() else {}
    video_file = path / "video_preprocessor_config.json"
    video_preprocessor = _read_json(video_file) if video_file.is_file() else {}
    return Checkpoint(path, family, config, tokenizer, tokens, preprocessor, video_preprocessor)


@functools.cache
def _open(path: Path) -> Checkpoint:
    return validate_checkpoint(path)


def open_checkpoint(source: str | Path, seed: int = 0) -> Checkpoint:
    """The validated checkpoint of ``model.source`` (``"tiny-omni"`` or a folder), read once per process."""
    return _open(resolve_source(source, seed))


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """Loads a checkpoint folder through its family's transformers class (validated first), in eval mode.

    Raises:
        CheckpointError: for a folder :func:`validate_checkpoint` rejects.
    """
    ckpt = _open(Path(path).expanduser().resolve())
    model = ckpt.family.load_class().from_pretrained(ckpt.path, dtype=dtype, local_files_only=True)
    torch.nn.Module.eval(model)
    return model


_MODEL_FILES = ("config.json", "generation_config.json")


def copy_side_files(source: str | Path, dest: str | Path) -> list[str]:
    """Copies a checkpoint folder's tokenizer, chat template and processor files (everything but the weights and
    the model / generation configs) into ``dest``, so a folder of new weights is a complete checkpoint.

    Returns:
        The names copied.
    """
    source, dest = Path(source), Path(dest)
    copied = []
    for f in sorted(source.iterdir()):
        skip = f.name in _MODEL_FILES or f.name.startswith("model") or f.name.startswith("pytorch_model")
        if f.is_file() and not skip:
            shutil.copy2(f, dest / f.name)
            copied.append(f.name)
    return copied
