"""Models the engines drive: checkpoint folders and their families, the default tiny omni thinker, and model inputs.

Every model is a local Hugging Face checkpoint folder; its tokenizer, chat template and every token id come from
the folder (:func:`open_checkpoint`), never from constants.

Names are resolved on first use (each from the module listed in ``_EXPORTS``): a process that only unpickles a
prompt (a queue actor holding prompt rows) imports :mod:`relax_services.models.inputs`, which imports this package
first, and must not pay for transformers' model code that the checkpoint and tiny-model modules bring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_services._lazy import lazy_exports

if TYPE_CHECKING:
    from relax_services.models.checkpoint import (
        DEFAULT_SOURCE,
        Checkpoint,
        CheckpointError,
        CheckpointNotFoundError,
        copy_side_files,
        load_model,
        open_checkpoint,
        resolve_source,
        validate_checkpoint,
    )
    from relax_services.models.families import FAMILIES, ModelFamily, UnsupportedArchitectureError, family_of
    from relax_services.models.inputs import (
        OmniPrompt,
        audio_token_count,
        check_placeholders,
        collate_media,
        join_media,
        pad_sequences,
        text_prompt,
    )
    from relax_services.models.modalities import MODEL_MODALITIES, ModelModality
    from relax_services.models.positions import prompt_positions, rope_positions, sequence_positions
    from relax_services.models.tiny_omni import (
        OmniModel,
        TinyOmniConfig,
        build_tiny_omni,
        num_parameters,
        tiny_omni_checkpoint,
        write_tiny_omni,
    )
    from relax_services.models.tokens import TokenIds, token_ids_from
    from relax_services.models.value import ValueModel, build_value_model

_EXPORTS: dict[str, str] = {
    "DEFAULT_SOURCE": "relax_services.models.checkpoint",
    "Checkpoint": "relax_services.models.checkpoint",
    "CheckpointError": "relax_services.models._light",
    "CheckpointNotFoundError": "relax_services.models._light",
    "copy_side_files": "relax_services.models.checkpoint",
    "load_model": "relax_services.models.checkpoint",
    "open_checkpoint": "relax_services.models.checkpoint",
    "resolve_source": "relax_services.models.checkpoint",
    "validate_checkpoint": "relax_services.models.checkpoint",
    "FAMILIES": "relax_services.models.families",
    "ModelFamily": "relax_services.models.families",
    "UnsupportedArchitectureError": "relax_services.models.families",
    "family_of": "relax_services.models.families",
    "OmniPrompt": "relax_services.models.inputs",
    "audio_token_count": "relax_services.models.inputs",
    "check_placeholders": "relax_services.models.inputs",
    "collate_media": "relax_services.models.inputs",
    "join_media": "relax_services.models.inputs",
    "pad_sequences": "relax_services.models.inputs",
    "text_prompt": "relax_services.models.inputs",
    "MODEL_MODALITIES": "relax_services.models.modalities",
    "ModelModality": "relax_services.models.modalities",
    "prompt_positions": "relax_services.models.positions",
    "rope_positions": "relax_services.models.positions",
    "sequence_positions": "relax_services.models.positions",
    "OmniModel": "relax_services.models.tiny_omni",
    "TinyOmniConfig": "relax_services.models.tiny_omni",
    "build_tiny_omni": "relax_services.models.tiny_omni",
    "num_parameters": "relax_services.models.tiny_omni",
    "tiny_omni_checkpoint": "relax_services.models.tiny_omni",
    "write_tiny_omni": "relax_services.models.tiny_omni",
    "TokenIds": "relax_services.models.tokens",
    "token_ids_from": "relax_services.models.tokens",
    "ValueModel": "relax_services.models.value",
    "build_value_model": "relax_services.models.value",
}

# checkpoints and families
__all__ = [
    "DEFAULT_SOURCE",
    "FAMILIES",
    "Checkpoint",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ModelFamily",
    "TokenIds",
    "UnsupportedArchitectureError",
    "copy_side_files",
    "family_of",
    "load_model",
    "open_checkpoint",
    "resolve_source",
    "token_ids_from",
    "validate_checkpoint",
]

# the default tiny omni model
__all__ += [
    "OmniModel",
    "TinyOmniConfig",
    "build_tiny_omni",
    "num_parameters",
    "tiny_omni_checkpoint",
    "write_tiny_omni",
]

# critic
__all__ += [
    "ValueModel",
    "build_value_model",
]

# the modality seam
__all__ += [
    "MODEL_MODALITIES",
    "ModelModality",
]

# inputs
__all__ += [
    "OmniPrompt",
    "audio_token_count",
    "check_placeholders",
    "collate_media",
    "join_media",
    "pad_sequences",
    "prompt_positions",
    "rope_positions",
    "sequence_positions",
    "text_prompt",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
