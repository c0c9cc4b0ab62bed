"""Tiny tokenizer, vocabulary constants and chat builder (fixed ids)."""

import pytest

from relax_modalities.text import (
    CHARACTERS,
    SPECIAL_TOKENS,
    TINY_SPECIAL_IDS,
    TINY_VOCAB,
    ChatBuilder,
    ChatTemplate,
    MediaSlot,
    TinyTokenizer,
    TokenizationError,
    Tokenizer,
    build_chat,
    never_sample_ids,
    tiny_hf_tokenizer,
)


def test_vocab_layout_matches_spec() -> None:
    assert TINY_VOCAB.vocab_size == 64 == len(SPECIAL_TOKENS) + len(CHARACTERS)
    expected = {
        "<|pad|>": 0, "<|bos|>": 1, "<|eos|>": 2, "<|user|>": 3, "<|assistant|>": 4, "<|vision_start|>": 5,
        "<|vision_end|>": 6, "<|image_pad|>": 7, "<|video_pad|>": 8, "<|audio_start|>": 9, "<|audio_end|>": 10,
        "<|audio_pad|>": 11,
    }  # fmt: skip
    assert expected == TINY_SPECIAL_IDS
    v = TINY_VOCAB
    assert (v.image_pad_id, v.video_pad_id, v.audio_pad_id, v.eos_id, v.user_id) == (7, 8, 11, 2, 3)
    tok = TinyTokenizer()
    assert tok.encode("09az A E") == [12, 21, 22, 47, 48, 49, 48, 53]
    assert tok.encode("+-*=?.,:!\n") == list(range(54, 64))
    assert len(set(CHARACTERS)) == len(CHARACTERS)


def test_never_sample_ids_are_all_specials_but_eos() -> None:
    assert never_sample_ids() == [0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def test_roundtrip_and_special_tokens() -> None:
    tok = TinyTokenizer()
    assert isinstance(tok, Tokenizer)
    text = "<|bos|><|user|>what is 3+4?<|assistant|>7<|eos|>"
    ids = tok.encode(text)
    assert ids[:2] == [1, 3] and ids[-2:] == [19, 2]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "what is 3+4?7"


def test_unknown_characters_raise() -> None:
    with pytest.raises(TokenizationError, match="'F'"):
        TinyTokenizer().encode("F")
    with pytest.raises(ValueError, match="outside"):
        TinyTokenizer().decode([64])


def test_hf_tokenizer_matches_plain_python() -> None:
    hf = tiny_hf_tokenizer()
    tok = TinyTokenizer()
    assert isinstance(hf, Tokenizer)
    assert hf.vocab_size == len(hf) == 64
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    for text in ["<|bos|><|user|>A or B?<|assistant|>7<|eos|>", "which colour? r, g or b.\n", "<|audio_pad|>x!"]:
        assert hf.encode(text) == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text
    assert hf.decode(tok.encode("<|bos|>ab<|eos|>"), skip_special_tokens=True) == "ab"
    assert hf.convert_tokens_to_ids("<|video_pad|>") == TINY_VOCAB.video_pad_id
    with pytest.raises(Exception, match="UNK"):
        hf.encode("F")


def test_chat_builder_places_placeholder_spans() -> None:
    tok = TinyTokenizer()
    prompt = build_chat(tok, "colour?", [MediaSlot("image", 4), MediaSlot("audio", 25)])
    ids = prompt.input_ids
    # hand-derived: <bos><user> <vs> 4×img <ve> <as> 25×aud <ae> c o l o u r ? <assistant>
    expected = [1, 3, 5, *[7] * 4, 6, 9, *[11] * 25, 10, 24, 36, 33, 36, 42, 39, 58, 4]
    assert ids == expected
    assert [(s.modality, s.start, s.length) for s in prompt.spans] == [("image", 3, 4), ("audio", 9, 25)]


def test_chat_builder_response_and_video() -> None:
    tok = TinyTokenizer()
    b = ChatBuilder(tok)
    p = b.build("2+2=", [MediaSlot("video", 8)], add_generation_prompt=False)
    assert tok.decode(p.input_ids) == "<|bos|><|user|><|vision_start|>" + "<|video_pad|>" * 8 + "<|vision_end|>2+2="
    assert b.response_ids("4") == [16, TINY_VOCAB.eos_id]
    assert b.placeholder_id("video") == TINY_VOCAB.video_pad_id
    with pytest.raises(ValueError, match="no system turn"):
        b.build("x", system="be short")


def test_template_tokens_must_be_single_tokens() -> None:
    with pytest.raises(ValueError):
        ChatBuilder(TinyTokenizer(), ChatTemplate.qwen())
    with pytest.raises(ValueError, match="num_tokens"):
        MediaSlot("image", 0)


class _QwenLikeTokenizer:
    """Character tokenizer carrying Qwen2.5-Omni's special token strings (built locally, no hub)."""

    SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|IMAGE|>", "<|VIDEO|>",
                "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>")  # fmt: skip

    def __init__(self) -> None:
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        chars = sorted(set("abcdefghijklmnopqrstuvwxyz \n?"))
        vocab = {t: i for i, t in enumerate([*self.SPECIALS, *chars])}
        self._tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        self._tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        self._tok.decoder = decoders.Fuse()
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.SPECIALS])

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_tokens_to_ids(self, tokens: str) -> int:
        return int(self._tok.token_to_id(tokens))


def test_qwen_template_renders_the_qwen_layout() -> None:
    tok = _QwenLikeTokenizer()
    assert isinstance(tok, Tokenizer)
    prompt = build_chat(
        tok, "why?", [MediaSlot("image", 2), MediaSlot("audio", 3)], system="be brief", template=ChatTemplate.qwen()
    )
    assert tok.decode(prompt.input_ids) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n<|vision_start|><|IMAGE|><|IMAGE|><|vision_end|>"
        "<|audio_bos|><|AUDIO|><|AUDIO|><|AUDIO|><|audio_eos|>why?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert [(s.modality, s.length) for s in prompt.spans] == [("image", 2), ("audio", 3)]
