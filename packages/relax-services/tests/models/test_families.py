"""Every family through the engines: tiny random checkpoints (the shared helper, with the locally built tokenizer
and chat template) give rollout and trainer log-probs equal to a plain transformers forward."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from relax_modalities.synthetic import MediaRef, TaskItem
from relax_services.config import ModelConfig
from relax_services.data.run_data import PromptBuilder
from relax_services.engines import HFRolloutEngine, SamplingParams, TorchTrainConfig, TorchTrainEngine, TrainSample
from relax_services.models import FAMILIES, OmniPrompt, load_model, open_checkpoint
from relax_services.models.tiny_families import write_tiny_checkpoint

FAMILY_MEDIA = {
    "qwen2": "text",
    "qwen3": "text",
    "llama": "text",
    "qwen2.5-vl": "image",
    "qwen3-vl": "image",
    "qwen2.5-omni-thinker": "image",
}
# Image tokens of the 56 × 84 px test image, by the Qwen-VL resize rule (sides rounded to patch × merge pixels,
# then scaled up to the minimum pixel budget): patch 14 with 56 × 56 px minimum: 56 × 84 px, 2 × 3 tokens;
# Qwen3-VL's patch 16 with 65536 px minimum: × sqrt(65536 / (56 · 84)) = 3.73, ceil to 32 px: 224 × 320, 7 × 10.
IMAGE_TOKENS = {"qwen2.5-vl": 6, "qwen3-vl": 70, "qwen2.5-omni-thinker": 6}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: write_tiny_checkpoint(root / name, name, seed=3) for name in FAMILY_MEDIA}


@pytest.fixture(scope="module")
def image_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("media") / "green.png"
    rng = torch.Generator().manual_seed(0)
    pixels = (torch.rand(56, 84, 3, generator=rng) * 255).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(path)
    return path


def _prompt(folder: Path, media: str, image: Path) -> OmniPrompt:
    refs = (MediaRef("image", str(image)),) if media == "image" else ()
    item = TaskItem(id="x", task=media, prompt="3+4=" if media == "text" else "which colour? r g", media=refs)
    return PromptBuilder(ModelConfig(source=str(folder)))(item)


def _reference_logprobs(model: torch.nn.Module, prompt: OmniPrompt, response: list[int], banned: tuple[int, ...]):
    """One plain transformers forward of prompt + response (positions computed by transformers itself)."""
    ids = torch.cat([prompt.input_ids, torch.tensor(response)])[None]
    media = {k: v for k, v in prompt.media().items() if k != "video_second_per_grid"}
    if type(model).__name__.startswith(("Qwen2_5_VL", "Qwen3VL")):  # their forward's rope needs the token types
        media["mm_token_type_ids"] = (ids == model.config.image_token_id).int() + 2 * (
            ids == model.config.video_token_id
        ).int()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **media).logits[0].double()
    logits = logits[prompt.num_tokens - 1 : -1]  # [L, V] predicting each response token
    logits[:, list(banned)] = -math.inf
    logp = torch.log_softmax(logits, dim=-1)
    return logp[torch.arange(len(response)), torch.tensor(response)].float()


@pytest.mark.parametrize("family", list(FAMILY_MEDIA))
def test_rollout_and_trainer_logprobs_equal_a_plain_forward(
    family: str, folders: dict[str, Path], image_file: Path
) -> None:
    ckpt = open_checkpoint(folders[family])
    assert ckpt.family.name == family and ckpt.family in FAMILIES.values()
    tokens = ckpt.tokens
    prompt = _prompt(folders[family], FAMILY_MEDIA[family], image_file)
    if FAMILY_MEDIA[family] == "image":
        assert int((prompt.input_ids == tokens.placeholders["image"]).sum()) == IMAGE_TOKENS[family]
    model = load_model(folders[family])
    params = SamplingParams(n=3, max_new_tokens=6, suppressed_ids=tokens.never_sample, eos_id=tokens.eos_id)
    completions = HFRolloutEngine(model).generate([prompt, prompt], params)
    engine = TorchTrainEngine(load_model(folders[family]), TorchTrainConfig(suppressed_ids=tokens.never_sample))
    samples = [TrainSample(prompt, torch.tensor(c.token_ids)) for group in completions for c in group]
    trainer_logp, mask = engine.compute_logprobs(samples)
    for row, c in enumerate(c for group in completions for c in group):
        assert not set(c.token_ids) & set(tokens.never_sample)
        ref = _reference_logprobs(model, prompt, c.token_ids, tokens.never_sample)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)
        n = len(c.token_ids)
        torch.testing.assert_close(trainer_logp[row, :n], ref, atol=1e-5, rtol=0)
        assert mask[row, :n].all()


def test_text_family_never_samples_the_tokenizers_specials(folders: dict[str, Path]) -> None:
    ckpt = open_checkpoint(folders["qwen3"])
    tok = ckpt.tokenizer
    specials = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert ckpt.tokens.placeholders == {}
    assert set(ckpt.tokens.never_sample) == specials - {tok.eos_token_id}


def _qwen3_vl_video_prompt(folder: Path, frame_blocks: bool) -> OmniPrompt:
    """A video prompt laid out as Qwen3-VL's processor writes it: per temporal grid step a timestamp (as text) and
    its own vision block (``frame_blocks``), or (not) one block for the whole clip as the clip layout writes."""
    ckpt = open_checkpoint(folder)
    tok, ids = ckpt.tokenizer, ckpt.tokens.placeholders
    grid = torch.tensor([[2, 4, 4]])  # 2 temporal steps of 4 × 4 patches: 4 tokens each after the 2 × 2 merge
    rng = torch.Generator().manual_seed(4)
    pixels = torch.randn(32, 3 * 2 * 16 * 16, generator=rng)  # [t·h·w, C·tp·p·p]
    body: list[int] = []
    if frame_blocks:
        for seconds in (0.5, 1.5):
            body += tok.encode(f"{seconds:.1f} seconds", add_special_tokens=False)
            body += [ids["vision_start"], *[ids["video"]] * 4, ids["vision_end"]]
    else:
        body = [ids["vision_start"], *[ids["video"]] * 8, ids["vision_end"]]
    head = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    tail = tok.encode("which colour? r g<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    return OmniPrompt(
        torch.tensor(head + body + tail),
        pixel_values_videos=pixels,
        video_grid_thw=grid,
        video_second_per_grid=torch.tensor([1.0]),
    )


def test_qwen3_vl_video_with_frame_blocks_scores_as_a_plain_forward(folders: dict[str, Path]) -> None:
    folder = folders["qwen3-vl"]
    ckpt = open_checkpoint(folder)
    tokens = ckpt.tokens
    prompt = _qwen3_vl_video_prompt(folder, frame_blocks=True)
    model = load_model(folder)
    params = SamplingParams(n=2, max_new_tokens=5, suppressed_ids=tokens.never_sample, eos_id=tokens.eos_id)
    completions = HFRolloutEngine(model).generate([prompt], params)
    engine = TorchTrainEngine(load_model(folder), TorchTrainConfig(suppressed_ids=tokens.never_sample))
    samples = [TrainSample(prompt, torch.tensor(c.token_ids)) for c in completions[0]]
    trainer_logp, _ = engine.compute_logprobs(samples)
    for row, c in enumerate(completions[0]):
        ref = _reference_logprobs(model, prompt, c.token_ids, tokens.never_sample)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(trainer_logp[row, : len(c.token_ids)], ref, atol=1e-5, rtol=0)


def test_qwen3_vl_video_as_one_block_is_refused(folders: dict[str, Path]) -> None:
    folder = folders["qwen3-vl"]
    tokens = open_checkpoint(folder).tokens
    prompt = _qwen3_vl_video_prompt(folder, frame_blocks=False)
    engine = TorchTrainEngine(load_model(folder), TorchTrainConfig(suppressed_ids=tokens.never_sample))
    with pytest.raises(ValueError, match="2 temporal grid steps but 1 runs of video tokens"):
        engine.compute_logprobs([TrainSample(prompt, torch.tensor([12, 13]))])


def test_qwen3_vl_video_from_the_data_path_scores_as_a_plain_forward(folders: dict[str, Path], tmp_path: Path) -> None:
    # The video path writes Qwen3-VL's layout itself: rollout and trainer log-probs of a prompt built from a file
    # equal one plain transformers forward (whose own rope reads one grid row per timestamped block).
    from relax_modalities.synthetic import write_mp4

    folder = folders["qwen3-vl"]
    tokens = open_checkpoint(folder).tokens
    frames = np.zeros((4, 56, 56, 3), dtype=np.uint8)
    for k in range(4):  # a 28-px square moving right, as the synthetic video task draws it
        frames[k, 14:42, 9 * k : 9 * k + 28] = 220
    write_mp4(tmp_path / "move.mp4", frames, fps=4)
    item = TaskItem(
        id="v", task="video", prompt="move? l r u d", media=(MediaRef("video", str(tmp_path / "move.mp4")),)
    )
    prompt = PromptBuilder(ModelConfig(source=str(folder)))(item)
    # 4 frames (the minimum) of 56 × 56 px rounded to 64 × 64: 2 temporal steps of 2 × 2 merged tokens each.
    assert prompt.video_grid_thw is not None and prompt.video_grid_thw.tolist() == [[2, 4, 4]]
    video = prompt.input_ids == tokens.placeholders["video"]
    assert int(video.sum()) == 8 and int((video[1:] & ~video[:-1]).sum()) == 2  # two blocks of 4
    model = load_model(folder)
    params = SamplingParams(n=3, max_new_tokens=5, suppressed_ids=tokens.never_sample, eos_id=tokens.eos_id)
    completions = HFRolloutEngine(model).generate([prompt, prompt], params)
    engine = TorchTrainEngine(load_model(folder), TorchTrainConfig(suppressed_ids=tokens.never_sample))
    flat = [c for group in completions for c in group]
    trainer_logp, mask = engine.compute_logprobs([TrainSample(prompt, torch.tensor(c.token_ids)) for c in flat])
    for row, c in enumerate(flat):
        ref = _reference_logprobs(model, prompt, c.token_ids, tokens.never_sample)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(trainer_logp[row, : len(c.token_ids)], ref, atol=1e-5, rtol=0)
        assert mask[row, : len(c.token_ids)].all()


@pytest.mark.parametrize("name", list(FAMILY_MEDIA))
def test_every_family_prompt_is_tokenized_as_its_tokenizer_file_says(folders: dict[str, Path], name: str) -> None:
    # The 64-id vocabulary's order (tiny_tokenizer): <|im_start|> 1, <|im_end|> 2, user 10, assistant 11, '2' 14,
    # '4' 16, '+' 54, '=' 57, newline 63. AutoTokenizer alone gave the Qwen2 checkpoint Qwen2Tokenizer's
    # byte-level pre-tokenizer: the newlines vanished and "user" / "assistant" came out letter by letter (20 ids).
    item = TaskItem(id="add-24", task="text", prompt="2+4=", answer="6", options=tuple("0123456789"), chance=0.1)
    ids = PromptBuilder(ModelConfig(source=str(folders[name])))(item).input_ids.tolist()
    assert ids == [1, 10, 63, 14, 54, 16, 57, 2, 63, 1, 11, 63]
    tokenizer = open_checkpoint(folders[name]).tokenizer
    assert tokenizer.decode(ids) == "<|im_start|>user\n2+4=<|im_end|>\n<|im_start|>assistant\n"


def test_a_qwen2_checkpoint_of_another_shape(tmp_path: Path) -> None:
    """``shape`` replaces the tiny sizes (a published config's, e.g. tied embeddings and its rotary base); the
    vocabulary stays the tiny tokenizer's. Parameters: embedding 64·32 (tied: once); per layer q 32·32+32, k and v
    32·16+16 each, o 32·32, MLP 3·32·48, 2 norms of 32; the final norm 32."""
    shape = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }
    folder = write_tiny_checkpoint(tmp_path / "q2", "qwen2", shape=shape)
    model = open_checkpoint(folder).load_model()
    config = model.config
    assert {k: getattr(config, k) for k in shape if k != "rope_parameters"} == {
        k: v for k, v in shape.items() if k != "rope_parameters"
    }
    assert config.rope_parameters["rope_theta"] == 1000000.0 and config.vocab_size == 64
    expected = 64 * 32 + (32 * 32 + 32 + 2 * (32 * 16 + 16) + 32 * 32 + 3 * 32 * 48 + 2 * 32) + 32
    assert sum(p.numel() for p in model.parameters()) == expected


def test_a_qwen2_checkpoint_with_a_padded_vocabulary(tmp_path: Path) -> None:
    """``shape={"vocab_size": V}`` pads the embedding and LM head to V rows that no token maps to (as Qwen2.5's
    151,936 rows for 151,665 tokens); the checkpoint validates and its model has V rows."""
    folder = write_tiny_checkpoint(tmp_path / "q2", "qwen2", shape={"vocab_size": 100})
    ckpt = open_checkpoint(folder)
    assert ckpt.tokens.vocab_size == 100 and len(ckpt.tokenizer) == 64
    model = ckpt.load_model()
    assert model.get_input_embeddings().weight.shape[0] == model.lm_head.weight.shape[0] == 100


@pytest.mark.parametrize(
    ("family", "kwargs", "words"),
    [
        ("qwen3", {"shape": {"hidden_size": 32}}, "for family 'qwen2' only"),
        ("qwen2", {"shape": {"vocab_size": 63}}, "vocab_size=63 must be an int >= the tiny tokenizer's 64"),
        ("qwen2", {"shape": {"pad_token_id": 3}}, "pad_token_id"),
        ("qwen2", {"shape": {"hidden_size": 32}, "hidden_size": 32}, "not both"),
    ],
)
def test_shape_errors(tmp_path: Path, family: str, kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        write_tiny_checkpoint(tmp_path / "x", family, **kwargs)
    assert not (tmp_path / "x").exists()
