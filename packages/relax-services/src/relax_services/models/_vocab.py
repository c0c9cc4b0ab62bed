"""Ids of the tiny 64-token character vocabulary shared with relax-modalities.

The tokenizer itself lives in ``relax_modalities.text``; this module only names the fixed ids the model
config and the engines need, so that the model can be built before (and without) the tokenizer.
"""

from __future__ import annotations

VOCAB_SIZE = 64

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
USER_ID = 3
ASSISTANT_ID = 4
VISION_START_ID = 5
VISION_END_ID = 6
IMAGE_PAD_ID = 7
VIDEO_PAD_ID = 8
AUDIO_START_ID = 9
AUDIO_END_ID = 10
AUDIO_PAD_ID = 11

# Ids a policy must never emit: sampling them breaks the chat layout, and multimodal placeholders in a
# response crash the rope-index computation of the next forward.  EOS (2) stays allowed: it ends the answer.
SUPPRESSED_IDS: tuple[int, ...] = (
    PAD_ID,
    BOS_ID,
    USER_ID,
    ASSISTANT_ID,
    VISION_START_ID,
    VISION_END_ID,
    IMAGE_PAD_ID,
    VIDEO_PAD_ID,
    AUDIO_START_ID,
    AUDIO_END_ID,
    AUDIO_PAD_ID,
)

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
