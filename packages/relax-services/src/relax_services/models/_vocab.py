"""Ids of the tiny 64-token vocabulary, taken from ``relax_modalities.text`` (the tokenizer's owner).

The engines and the model config read the ids from here, under short names.
"""

from __future__ import annotations

from relax_modalities.text import TINY_VOCAB, never_sample_ids

VOCAB_SIZE = TINY_VOCAB.vocab_size

PAD_ID = TINY_VOCAB.pad_id
BOS_ID = TINY_VOCAB.bos_id
EOS_ID = TINY_VOCAB.eos_id
USER_ID = TINY_VOCAB.user_id
ASSISTANT_ID = TINY_VOCAB.assistant_id
VISION_START_ID = TINY_VOCAB.vision_start_id
VISION_END_ID = TINY_VOCAB.vision_end_id
IMAGE_PAD_ID = TINY_VOCAB.image_pad_id
VIDEO_PAD_ID = TINY_VOCAB.video_pad_id
AUDIO_START_ID = TINY_VOCAB.audio_start_id
AUDIO_END_ID = TINY_VOCAB.audio_end_id
AUDIO_PAD_ID = TINY_VOCAB.audio_pad_id

# Ids a policy must never emit: every special token but EOS. Sampling them breaks the chat layout, and
# multimodal placeholders in a response crash the rope-index computation of the next forward.
SUPPRESSED_IDS: tuple[int, ...] = tuple(never_sample_ids())

# Media markers and placeholders: inside a response they would be taken for media by the model's forward.
MEDIA_IDS: tuple[int, ...] = (
    VISION_START_ID,
    VISION_END_ID,
    IMAGE_PAD_ID,
    VIDEO_PAD_ID,
    AUDIO_START_ID,
    AUDIO_END_ID,
    AUDIO_PAD_ID,
)
