"""Tests of the tiny omni model builder, checkpoint loading and model inputs."""

from __future__ import annotations

import pytest
import torch

from relax_services.engines.scoring import distinct_prompts
from relax_services.models import (
    DEFAULT_SOURCE,
    CheckpointError,
    OmniPrompt,
    TinyOmniConfig,
    audio_token_count,
    build_tiny_omni,
    check_placeholders,
    collate_media,
    copy_side_files,
    load_model,
    num_parameters,
    open_checkpoint,
    pad_sequences,
    rope_positions,
    sequence_positions,
)
from relax_services.models.embeddings import embed_inputs
from relax_services.models.synthetic import synthetic_prompt

CKPT = open_checkpoint(DEFAULT_SOURCE)
TOKENS = CKPT.tokens


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_omni(seed=0)


def _plain_logits(model: torch.nn.Module, prompt: OmniPrompt) -> torch.Tensor:
    """Logits of one unpadded prompt, positions computed by transformers itself."""
    ids = prompt.input_ids[None]
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), **prompt.media()).logits[0]


def test_tiny_model_has_the_documented_size_and_token_ids(model: torch.nn.Module) -> None:
    assert 400_000 < num_parameters(model) < 460_000  # DESIGN.md: ≈ 0.43 M
    cfg = model.config
    assert cfg.text_config.vocab_size == 64 == len(CKPT.tokenizer)
    tid = CKPT.tokenizer.convert_tokens_to_ids
    assert [cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id] == tid(["<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>"])
    assert [cfg.vision_start_token_id, cfg.vision_end_token_id] == tid(["<|vision_bos|>", "<|vision_eos|>"])
    assert [cfg.audio_start_token_id, cfg.audio_end_token_id, cfg.user_token_id] == tid(
        ["<|audio_bos|>", "<|audio_eos|>", "user"]
    )
    gen = model.generation_config
    assert [gen.pad_token_id, gen.eos_token_id] == tid(["<|endoftext|>", "<|im_end|>"])
    # Never sampled: every special token of the tokenizer but the eos (hand-listed strings).
    specials = ["<|endoftext|>", "<|im_start|>", "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>"]
    specials += ["<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
    assert TOKENS.eos_id not in TOKENS.never_sample and set(TOKENS.never_sample) == set(tid(specials))


def test_build_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_tiny_omni(seed=1), build_tiny_omni(seed=1), build_tiny_omni(seed=2)
    assert torch.rand(1) == before
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mrope_section": (4, 2, 1)}, "mrope_section"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"hidden_size": 66}, "hidden_size"),
        ({"attn_implementation": "flash"}, "attn_implementation"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TinyOmniConfig(**kwargs)  # type: ignore[arg-type]


def test_media_token_counts(model: torch.nn.Module) -> None:
    # 56 × 56 px image: 4 × 4 patches of 14 px, merged 2 × 2 -> 4 tokens.
    pixels = torch.randn(16, 3 * 2 * 14 * 14)
    feats = model.get_image_features(pixels, torch.tensor([[1, 4, 4]])).pooler_output
    assert feats[0].shape == (4, 64)
    # 1 s of audio = 100 log-mel frames -> 25 tokens; the formula against the encoder itself.
    assert audio_token_count(100) == 25
    for frames in (37, 100, 161):
        out = model.get_audio_features(
            torch.randn(1, 128, frames), feature_attention_mask=torch.ones(1, frames, dtype=torch.long)
        ).last_hidden_state
        assert out.shape == (audio_token_count(frames), 64)


def test_prompt_validation_errors() -> None:
    ph = TOKENS.placeholders
    ids = torch.tensor([1, 10, ph["audio_start"], ph["audio"], ph["audio"], ph["audio_end"], 11])
    with pytest.raises(ValueError, match="no input_features"):
        check_placeholders(OmniPrompt(input_ids=ids), TOKENS)
    with pytest.raises(ValueError, match="audio placeholder tokens"):
        prompt = OmniPrompt(
            input_ids=ids,
            input_features=torch.zeros(1, 128, 100),
            feature_attention_mask=torch.ones(1, 100, dtype=torch.long),
        )
        check_placeholders(prompt, TOKENS)
    image_ids = torch.tensor([1, 10, ph["vision_start"], ph["image"], ph["vision_end"], 11])
    with pytest.raises(ValueError, match="image"):
        check_placeholders(OmniPrompt(input_ids=image_ids), TOKENS)
    with pytest.raises(ValueError, match="patches"):
        OmniPrompt(
            input_ids=image_ids,
            pixel_values=torch.zeros(15, 1176),
            image_grid_thw=torch.tensor([[1, 4, 4]]),
        )


def test_left_padded_batch_matches_each_prompt_alone(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [
        synthetic_prompt(kind, [12 + i] * (i + 1), gen)
        for i, kind in enumerate(["text", "image", "video", "audio", "image"])
    ]
    ids, mask = pad_sequences([p.input_ids for p in prompts], TOKENS.pad_id, side="left")
    media = collate_media(prompts)
    positions = rope_positions(model, ids, mask, media)
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask, position_ids=positions, **media).logits
    for i, prompt in enumerate(prompts):
        alone = _plain_logits(model, prompt)
        torch.testing.assert_close(batched[i, -prompt.num_tokens :], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_cached_sequence_positions_equal_the_models_rope_index(model: torch.nn.Module, side: str) -> None:
    gen = torch.Generator().manual_seed(4)
    kinds = ["image", "text", "video", "audio", "image", "video"]
    prompts = [synthetic_prompt(kind, [20 + i] * (1 + i % 3), gen) for i, kind in enumerate(kinds)]
    suffixes = [0, 3, 5, 1, 2, 4]
    seqs = [
        torch.cat([p.input_ids, torch.randint(12, 48, (k,), generator=gen)])
        for p, k in zip(prompts, suffixes, strict=True)
    ]
    ids, mask = pad_sequences(seqs, TOKENS.pad_id, side=side)
    expected = rope_positions(model, ids, mask, collate_media(prompts))
    for _ in range(2):  # cold and cached
        positions, next_positions = sequence_positions(model, prompts, suffixes, side=side)
        assert torch.equal(positions, expected)
    real = expected.masked_fill(mask[None] == 0, -1)
    assert torch.equal(next_positions, real.amax(dim=(0, 2)) + 1)


def test_save_pretrained_round_trip(model: torch.nn.Module, tmp_path: object) -> None:
    path = tmp_path / "ckpt"  # type: ignore[operator]
    model.save_pretrained(path)
    with pytest.raises(CheckpointError, match="no tokenizer"):  # weights alone are not a checkpoint
        load_model(path)
    copy_side_files(CKPT.path, path)
    loaded = load_model(path)
    prompt = synthetic_prompt("video", [13, 14], torch.Generator().manual_seed(1))
    torch.testing.assert_close(_plain_logits(loaded, prompt), _plain_logits(model, prompt), atol=0, rtol=0)
    assert loaded.config.vision_start_token_id == TOKENS.placeholders["vision_start"]


def test_load_model_rejects_a_non_checkpoint(tmp_path: object) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path)  # type: ignore[arg-type]


def test_deduplicated_media_embeddings_match_the_models_own_merge(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(6)
    base = [synthetic_prompt(kind, [30, 31], gen) for kind in ("image", "audio", "video", "text")]
    # Rows of a group: the same object, a content-equal copy, and the other prompts interleaved.
    copy = OmniPrompt(**{k: v.clone() for k, v in {"input_ids": base[0].input_ids, **base[0].media()}.items()})
    prompts = [base[0], base[1], copy, base[2], base[0], base[3], base[1]]
    ids, mask = pad_sequences([p.input_ids for p in prompts], TOKENS.pad_id, side="right")
    media = collate_media(prompts)
    positions = rope_positions(model, ids, mask, media)
    encoded: list[int] = []
    hooks = [
        model.visual.register_forward_hook(lambda _m, args, _out: encoded.append(args[0].shape[0])),
        model.audio_tower.register_forward_hook(lambda _m, args, _out: encoded.append(args[0].shape[-1])),
    ]
    try:
        with torch.no_grad():
            embeds = embed_inputs(model, prompts, ids, "cpu")
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(encoded) == [16, 32, 100]  # one image (16 patches), one video (32), one clip (100 frames)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions, **media).logits
        got = model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_distinct_prompts_groups_rows_by_object_then_content() -> None:
    gen = torch.Generator().manual_seed(5)
    image = synthetic_prompt("image", [14, 15], gen)
    copy = OmniPrompt(**{k: v.clone() for k, v in {"input_ids": image.input_ids, **image.media()}.items()})
    other_pixels = dict(image.media(), pixel_values=image.pixel_values + 1.0)  # same ids and shapes, other image
    other = OmniPrompt(input_ids=image.input_ids.clone(), **other_pixels)
    text = synthetic_prompt("text", [14, 15], gen)
    distinct, index = distinct_prompts([image, text, image, copy, other, text])
    assert distinct == [image, text, other] and distinct[0] is image and distinct[2] is other
    assert index.tolist() == [0, 1, 0, 0, 2, 1]
    assert image.fingerprint() == copy.fingerprint() != other.fingerprint()


@pytest.mark.parametrize("modality", ["text", "image", "video", "audio"])
def test_prompt_pickles_through_numpy_and_comes_back_equal_and_writable(modality: str) -> None:
    import pickle
    import warnings

    import ray.cloudpickle as cloudpickle

    from relax_services.models.inputs import _prompt_from_arrays

    prompt = synthetic_prompt(modality, [14, 15], torch.Generator().manual_seed(3))
    assert prompt.__reduce_ex__(5)[0] is _prompt_from_arrays  # not torch.save per tensor
    for dumps in (pickle.dumps, cloudpickle.dumps):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. torch's warning about non-writable numpy memory
            back = pickle.loads(dumps(prompt))
        assert back.fingerprint() == prompt.fingerprint()
        for name, value in {"input_ids": prompt.input_ids, **prompt.media()}.items():
            got = getattr(back, name)
            assert got.dtype == value.dtype and torch.equal(got, value)
            got.add_(0)  # owns writable memory
        assert back.media().keys() == prompt.media().keys()
    grad = OmniPrompt(input_ids=prompt.input_ids, **prompt.media())
    object.__setattr__(grad, "input_ids", grad.input_ids.float().requires_grad_())
    assert pickle.loads(pickle.dumps(grad)).input_ids.requires_grad  # the default pickling, unchanged
