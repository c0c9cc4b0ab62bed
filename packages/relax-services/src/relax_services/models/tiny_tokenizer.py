"""The default model's tokenizer, built locally with the ``tokenizers`` library (no download).

A WordLevel vocabulary of 64 ids: Qwen2.5-Omni's special-token strings (ids 0–9), the role words ``user`` and
``assistant`` (10–11), and 52 characters, one token each (12–63: digits, a–z, space, A–E, ``+-*=?.,:!`` and
newline). The synthetic tasks' answers are single characters, so each is one token. Its chat template is
Qwen's ``<|im_start|>role\\n … <|im_end|>\\n`` layout with one placeholder per media part, which the data path
expands to the item's token count (as transformers' processors do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TINY_CHARACTERS", "build_tiny_tokenizer"]

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",  # pad
    "<|im_start|>",
    "<|im_end|>",  # eos: ends every turn, the assistant's answer included
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|AUDIO|>",
)
ROLE_WORDS: tuple[str, ...] = ("user", "assistant")
TINY_CHARACTERS: tuple[str, ...] = (
    *"0123456789",
    *"abcdefghijklmnopqrstuvwxyz",
    " ",
    *"ABCDE",
    *"+-*=?.,:!",
    "\n",
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_bos|><|IMAGE|><|vision_eos|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_bos|><|VIDEO|><|vision_eos|>' -}}"
    "{%- elif part['type'] == 'audio' -%}{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""Jinja chat template of the default model (media parts render as one placeholder each)."""


def build_tiny_tokenizer(extra_characters: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """The default model's tokenizer as a transformers ``PreTrainedTokenizerFast`` with its chat template.

    Encoding a character outside the vocabulary raises (the vocabulary has no unknown token).

    Args:
        extra_characters: Characters added after the 64 ids (one token each; the other ids are unchanged), e.g.
            ``("<", ">")`` for the Qwen3-VL tiny checkpoint, whose video prompts carry ``<t seconds>`` text.

    Raises:
        ValueError: an extra character that is not one character or already in the vocabulary.
    """
    known = {*SPECIAL_TOKENS, *ROLE_WORDS, *TINY_CHARACTERS}
    for ch in extra_characters:
        if len(ch) != 1 or ch in known:
            raise ValueError(
                f"build_tiny_tokenizer: extra character {ch!r} must be one character not in the vocabulary"
            )
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Backend
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, *ROLE_WORDS, *TINY_CHARACTERS, *extra_characters))}
    backend = _Backend(models.WordLevel(vocab, unk_token="<|unk|>"))  # "<|unk|>" is absent: unknown raises
    words = "|".join(ROLE_WORDS)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(rf"{words}|[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
