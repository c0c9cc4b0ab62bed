"""Models the engines drive: checkpoint folders and their families, the default tiny omni thinker, and model inputs.

Every model is a local Hugging Face checkpoint folder; its tokenizer, chat template and every token id come from
the folder (:func:`open_checkpoint`), never from constants.
"""

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
    "pad_sequences",
    "prompt_positions",
    "rope_positions",
    "sequence_positions",
    "text_prompt",
]
