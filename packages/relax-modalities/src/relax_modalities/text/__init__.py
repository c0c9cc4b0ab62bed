"""Text path: the tokenizer protocol, chat rendering, and a small standalone character vocabulary.

`TemplateChat` renders a user turn with a checkpoint's own chat template (``apply_chat_template``) and expands
each media placeholder to the item's token count; the placeholder ids come from the checkpoint
(`CheckpointTemplate`). `ChatBuilder` renders fixed template strings (`ChatTemplate`) instead, for tokenizers
without a chat template. `TinyTokenizer` / `TINY_VOCAB` are a dependency-free 64-token character vocabulary for
using and testing this package on its own; nothing in the data path assumes them when a checkpoint's tokenizer
and template are given.
"""

from relax_modalities.text._chat import (
    MODALITIES,
    TINY_TEMPLATE,
    ChatBuilder,
    ChatPrompt,
    ChatTemplate,
    ChatTemplateTokenizer,
    CheckpointTemplate,
    MediaSlot,
    Modality,
    PlaceholderSpan,
    TemplateChat,
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
    "ChatTemplateTokenizer",
    "CheckpointTemplate",
    "MediaSlot",
    "Modality",
    "PlaceholderSpan",
    "TemplateChat",
    "build_chat",
]
