"""The tiny 64-token character vocabulary used by the CPU-scale omni model (ids fixed).

=====  ========================  ==========================================
 id    token                     role
=====  ========================  ==========================================
 0     ``<|pad|>``               padding
 1     ``<|bos|>``               starts every prompt
 2     ``<|eos|>``               ends the assistant answer
 3     ``<|user|>``              user turn
 4     ``<|assistant|>``         assistant turn (the generation prompt)
 5-6   ``<|vision_start|>`` …    vision span start / end
 7     ``<|image_pad|>``         one image placeholder token
 8     ``<|video_pad|>``         one video placeholder token
 9-10  ``<|audio_start|>`` …     audio span start / end
 11    ``<|audio_pad|>``         one audio placeholder token
 12-21 ``0`` … ``9``             digits
 22-47 ``a`` … ``z``             lower-case letters
 48    space
 49-53 ``A`` … ``E``             upper-case option letters
 54-63 ``+ - * = ? . , : !`` and newline
=====  ========================  ==========================================

One character is one token; there is no unknown token (encoding text outside the vocabulary is an error).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|user|>",
    "<|assistant|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
)
"""Special tokens in id order (ids 0..11)."""

CHARACTERS: tuple[str, ...] = (
    *"0123456789",
    *"abcdefghijklmnopqrstuvwxyz",
    " ",
    *"ABCDE",
    *"+-*=?.,:!",
    "\n",
)
"""Plain characters in id order (ids 12..63)."""

TINY_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)
assert TINY_VOCAB_SIZE == 64, TINY_VOCAB_SIZE


@dataclass(frozen=True)
class TinyVocab:
    """Ids of every special token of the tiny vocabulary.

    Attributes:
        pad_id: padding.
        bos_id: starts every prompt.
        eos_id: ends the assistant answer (the generation config's eos).
        user_id: ``<|user|>`` (the thinker config's ``user_token_id``).
        assistant_id: ``<|assistant|>``, the generation prompt.
        vision_start_id: starts an image or video span (config ``vision_start_token_id``).
        vision_end_id: ends an image or video span (config ``vision_end_token_id``).
        image_pad_id: image placeholder (config ``image_token_index``).
        video_pad_id: video placeholder (config ``video_token_index``).
        audio_start_id: starts an audio span (config ``audio_start_token_id``).
        audio_end_id: ends an audio span (config ``audio_end_token_id``).
        audio_pad_id: audio placeholder (config ``audio_token_index``).
        vocab_size: 64.
        first_char_id: id of the first plain character (``"0"``).
    """

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    user_id: int = 3
    assistant_id: int = 4
    vision_start_id: int = 5
    vision_end_id: int = 6
    image_pad_id: int = 7
    video_pad_id: int = 8
    audio_start_id: int = 9
    audio_end_id: int = 10
    audio_pad_id: int = 11
    vocab_size: int = TINY_VOCAB_SIZE
    first_char_id: int = len(SPECIAL_TOKENS)
    special_tokens: tuple[str, ...] = field(default=SPECIAL_TOKENS, repr=False)
    characters: tuple[str, ...] = field(default=CHARACTERS, repr=False)

    def never_sample_ids(self) -> list[int]:
        """Ids a policy must never sample: every special token except ``<|eos|>`` (0, 1, 3–11).

        Sampling a placeholder or span token would later crash the model's rope-index computation,
        so rollout suppresses these logits and training masks them out of log-probs.
        """
        return [i for i in range(len(self.special_tokens)) if i != self.eos_id]

    def char_ids(self) -> list[int]:
        """Ids of the plain characters (digits, letters, space, punctuation, newline)."""
        return list(range(self.first_char_id, self.vocab_size))


TINY_VOCAB = TinyVocab()
"""The tiny vocabulary's ids."""

TINY_SPECIAL_IDS: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
"""Special token string → id."""


def never_sample_ids() -> list[int]:
    """Ids of the tiny vocabulary that must never be sampled (see `TinyVocab.never_sample_ids`)."""
    return TINY_VOCAB.never_sample_ids()
