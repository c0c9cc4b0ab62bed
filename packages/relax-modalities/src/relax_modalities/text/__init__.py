"""Text path: the tokenizer protocol, the tiny 64-token vocabulary and the chat builder.

The tiny vocabulary is what the CPU-scale Qwen2.5-Omni thinker is built against: its special ids
are constants (`TINY_VOCAB`, `TINY_SPECIAL_IDS`) and `never_sample_ids()` lists the ids a policy
must never emit. `ChatBuilder` renders a user turn with the right number of placeholder tokens per
media item.
"""

from relax_modalities.text._chat import (
    MODALITIES,
    TINY_TEMPLATE,
    ChatBuilder,
    ChatPrompt,
    ChatTemplate,
    MediaSlot,
    Modality,
    PlaceholderSpan,
    build_chat,
)
from relax_modalities.text._tokenizer import (
    TinyTokenizer,
    TokenizationError,
    Tokenizer,
    tiny_hf_tokenizer,
    tiny_tokenizers_backend,
)
from relax_modalities.text._vocab import (
    CHARACTERS,
    SPECIAL_TOKENS,
    TINY_SPECIAL_IDS,
    TINY_VOCAB,
    TINY_VOCAB_SIZE,
    TinyVocab,
    never_sample_ids,
)

__all__ = [  # vocabulary
    "CHARACTERS",
    "SPECIAL_TOKENS",
    "TINY_SPECIAL_IDS",
    "TINY_VOCAB",
    "TINY_VOCAB_SIZE",
    "TinyVocab",
    "never_sample_ids",
]
__all__ += [  # tokenizers
    "TinyTokenizer",
    "TokenizationError",
    "Tokenizer",
    "tiny_hf_tokenizer",
    "tiny_tokenizers_backend",
]
__all__ += [  # chat
    "MODALITIES",
    "TINY_TEMPLATE",
    "ChatBuilder",
    "ChatPrompt",
    "ChatTemplate",
    "MediaSlot",
    "Modality",
    "PlaceholderSpan",
    "build_chat",
]
