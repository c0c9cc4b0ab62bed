"""`TemplateChat`: prompts rendered by a tokenizer's own chat template, each media placeholder expanded."""

from __future__ import annotations

import pytest

from relax_modalities.text import TINY_VOCAB, CheckpointTemplate, MediaSlot, TemplateChat, tiny_hf_tokenizer

V = TINY_VOCAB
# A minimal template over the tiny vocabulary's strings: one placeholder per media part.
TEMPLATE = (
    "{%- for m in messages -%}<|user|>{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif p['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif p['type'] == 'audio' -%}<|audio_start|><|audio_pad|><|audio_end|>"
    "{%- else -%}{{ p['text'] }}{%- endif -%}{%- endfor -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
IDS = CheckpointTemplate.of(
    {
        "image": V.image_pad_id,
        "video": V.video_pad_id,
        "audio": V.audio_pad_id,
        "vision_start": V.vision_start_id,
        "vision_end": V.vision_end_id,
        "audio_start": V.audio_start_id,
        "audio_end": V.audio_end_id,
    }
)


def _tokenizer():  # type: ignore[no-untyped-def]
    tok = tiny_hf_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_placeholders_expand_to_each_items_token_count() -> None:
    chat = TemplateChat(_tokenizer(), IDS)
    out = chat.build("1+2=", [MediaSlot("image", 3), MediaSlot("audio", 2)])
    digits = [V.first_char_id + 1, 54, V.first_char_id + 2, 57]  # "1", "+", "2", "="
    expected = [V.user_id, V.vision_start_id, *[V.image_pad_id] * 3, V.vision_end_id]
    expected += [V.audio_start_id, V.audio_pad_id, V.audio_pad_id, V.audio_end_id, *digits, V.assistant_id]
    assert out.input_ids == expected
    assert [(s.modality, s.start, s.length) for s in out.spans] == [("image", 2, 3), ("audio", 7, 2)]
    assert chat.response_ids("7") == [V.first_char_id + 7, V.eos_id]


def test_interleaved_video_sits_inside_the_vision_markers() -> None:
    chat = TemplateChat(_tokenizer(), IDS)
    out = chat.build("", [MediaSlot("video", 3, interleave=((2, 1), (1, 0)))])
    v, a = V.video_pad_id, V.audio_pad_id
    assert out.input_ids == [
        V.user_id, V.vision_start_id, V.audio_start_id, v, v, a, v, V.audio_end_id, V.vision_end_id, V.assistant_id
    ]  # fmt: skip
    assert [(s.modality, s.start, s.length) for s in out.spans] == [("video", 3, 2), ("audio", 5, 1), ("video", 6, 1)]


def test_a_tokenizer_without_template_or_placeholder_is_refused() -> None:
    with pytest.raises(ValueError, match="no chat template"):
        TemplateChat(tiny_hf_tokenizer(), IDS)
    tok = _tokenizer()
    tok.chat_template = "{%- for m in messages -%}{{ m['content'][-1]['text'] }}{%- endfor -%}"  # drops media parts
    with pytest.raises(ValueError, match="no placeholder for 1 media item"):
        TemplateChat(tok, IDS).build("1", [MediaSlot("image", 2)])
    with pytest.raises(ValueError, match="no audio placeholder"):
        TemplateChat(_tokenizer(), CheckpointTemplate.of({"image": V.image_pad_id})).build("1", [MediaSlot("audio", 2)])


def test_timestamped_frames_expand_inside_the_vision_markers() -> None:
    # Qwen3-VL's processor's expansion: per temporal step its text, then its own vision block, all in place of the
    # one video placeholder the template wrote between its vision markers.
    chat = TemplateChat(_tokenizer(), IDS)
    out = chat.build("", [MediaSlot("video", 3, frames=(("0.5", 2), ("1", 1)))])
    v, vs, ve = V.video_pad_id, V.vision_start_id, V.vision_end_id
    zero, one, five, dot = V.first_char_id, V.first_char_id + 1, V.first_char_id + 5, 59
    assert out.input_ids == [
        V.user_id, vs, zero, dot, five, vs, v, v, ve, one, vs, v, ve, ve, V.assistant_id
    ]  # fmt: skip
    assert [(s.modality, s.start, s.length) for s in out.spans] == [("video", 6, 2), ("video", 11, 1)]
    without_markers = CheckpointTemplate.of({"video": V.video_pad_id})
    with pytest.raises(ValueError, match="no vision_start marker"):
        TemplateChat(_tokenizer(), without_markers).build("", [MediaSlot("video", 1, frames=(("1", 1),))])


def test_the_plain_chat_builder_renders_timestamped_frames_alike() -> None:
    from relax_modalities.text import ChatBuilder, TinyTokenizer

    out = ChatBuilder(TinyTokenizer()).build("", [MediaSlot("video", 3, frames=(("0.5", 2), ("1", 1)))])
    v, vs, ve = V.video_pad_id, V.vision_start_id, V.vision_end_id
    zero, one, five, dot = V.first_char_id, V.first_char_id + 1, V.first_char_id + 5, 59
    assert out.input_ids == [
        V.bos_id, V.user_id, vs, zero, dot, five, vs, v, v, ve, one, vs, v, ve, ve, V.assistant_id
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("slot", "reason"),
    [
        (lambda: MediaSlot("image", 2, frames=(("1", 2),)), "only for video slots"),
        (lambda: MediaSlot("video", 3, frames=(("1", 2),)), "summing to num_tokens 3"),
        (lambda: MediaSlot("video", 2, frames=(("1", 2), ("2", 0))), "summing to num_tokens 2"),
        (lambda: MediaSlot("video", 2, interleave=((2, 1),), frames=(("1", 2),)), "without interleave"),
    ],
)
def test_bad_frame_blocks_are_refused(slot, reason: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=reason):
        slot()
