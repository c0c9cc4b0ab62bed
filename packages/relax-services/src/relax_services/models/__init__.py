"""Models the engines drive: the default tiny omni thinker, checkpoint loading, and model inputs."""

from relax_services.models._vocab import EOS_ID, PAD_ID, SUPPRESSED_IDS, VOCAB_SIZE
from relax_services.models.inputs import (
    OmniPrompt,
    audio_token_count,
    collate_media,
    pad_sequences,
    text_prompt,
)
from relax_services.models.positions import prompt_positions, rope_positions, sequence_positions
from relax_services.models.tiny_omni import OmniModel, TinyOmniConfig, build_tiny_omni, load_model, num_parameters
from relax_services.models.value import ValueModel, build_value_model

# tiny omni model
__all__ = [
    "OmniModel",
    "TinyOmniConfig",
    "build_tiny_omni",
    "load_model",
    "num_parameters",
]

# critic
__all__ += [
    "ValueModel",
    "build_value_model",
]

# inputs
__all__ += [
    "OmniPrompt",
    "audio_token_count",
    "collate_media",
    "pad_sequences",
    "prompt_positions",
    "rope_positions",
    "sequence_positions",
    "text_prompt",
]

# vocabulary
__all__ += [
    "EOS_ID",
    "PAD_ID",
    "SUPPRESSED_IDS",
    "VOCAB_SIZE",
]
