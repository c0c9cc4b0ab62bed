"""Image, audio and video an environment returns after the first turn, on the real transformers engine with the
default tiny omni model: the placeholders sit in the environment's turn with the item's token count, and every
assistant token's log-prob is the same in rollout (what the Completion records), in the Trainer's scoring of the
sample (after a pickle round trip, as through the queue) and in a plain float64 transformers forward of the whole
conversation (the model's own multimodal rope positions). The conversation without the item scores the tokens after
it differently and the tokens before it the same, so the media are in the forward, at their place.

Measured (float32 engine against the float64 forward): rollout and Trainer errors ≤ 1.8e-7 against a first-order
rounding bound of ≈ 9e-4; removing the item moves the next assistant tokens' log-probs by 5.7e-3 to 0.1."""

from __future__ import annotations

import copy
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from relax_modalities.synthetic import write_mp4
from relax_services.agents import AgentConfig, Episode, EpisodeMedia, EpisodeRunner, load_environment
from relax_services.engines import HFRolloutConfig, HFRolloutEngine, SamplingParams, TorchTrainConfig, TorchTrainEngine
from relax_services.engines.protocols import TrainSample
from relax_services.models import DEFAULT_SOURCE, build_tiny_omni, open_checkpoint

ENV = """
class Look:
    modalities = ("image", "audio", "video")

    def reset(self, row):
        self.row, self.turn = row, 0
        return [{"role": "user", "content": row["q"]}]

    def step(self, assistant_message):
        self.turn += 1
        if self.turn > 1:
            return [], None, True
        kind = self.row["kind"]
        parts = [{"type": "text", "text": "see "}, {"type": kind, kind: self.row["file"]}]
        return [{"role": "user", "content": parts}], None, False
"""

VERSION = 1
TEMPERATURE = 0.9
U32 = 2.0**-24  # float32 unit roundoff
KINDS = ("image", "audio", "video")


def _files(folder: Path) -> dict[str, str]:
    """A 56×56 image (4 tokens), 1 s of audio (25 tokens) and 4 frames of 56×56 video at 2 fps."""
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(folder / "a.png")
    sf.write(folder / "a.wav", np.sin(np.arange(16000) * 2 * np.pi * 440 / 16000).astype(np.float32), 16000)
    write_mp4(folder / "a.mp4", rng.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8), fps=2)
    return {"image": str(folder / "a.png"), "audio": str(folder / "a.wav"), "video": str(folder / "a.mp4")}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Episode], torch.nn.Module, tuple[int, ...]]:
    """Two episodes per modality, each shown the item after its first turn; the model and the suppressed ids."""
    folder = tmp_path_factory.mktemp("media")
    files = _files(folder)
    (folder / "env.py").write_text(ENV)
    ckpt = open_checkpoint(DEFAULT_SOURCE)
    tok = ckpt.tokenizer
    # Only the eos and four characters may be sampled, so the random model ends its turns within a few tokens.
    keep = {ckpt.tokens.eos_id, *(tok.convert_tokens_to_ids(c) for c in "abcd")}
    suppressed = tuple(i for i in range(ckpt.tokens.vocab_size) if i not in keep)
    params = SamplingParams(eos_id=ckpt.tokens.eos_id, suppressed_ids=suppressed, temperature=TEMPERATURE)
    model = build_tiny_omni(seed=0)
    engine = HFRolloutEngine(copy.deepcopy(model), HFRolloutConfig(seed=0), version=VERSION)
    config = AgentConfig(max_turns=3, max_new_tokens=12, max_episode_tokens=200)
    rows = [{"q": f"what is {i}?", "kind": kind, "file": files[kind]} for kind in KINDS for i in range(2)]
    env = load_environment(f"{folder / 'env.py'}:Look")
    with EpisodeRunner(engine, env, tok, ckpt.family, params, config, EpisodeMedia.of_checkpoint(ckpt)) as runner:
        groups = runner.run_sync(rows, group_size=2)
    episodes = [ep for group in groups for ep in group if ep.media_spans]
    assert {ep.media_spans[0][0] for ep in episodes} == set(KINDS), [ep.finish_reason for g in groups for ep in g]
    return episodes, model, suppressed


def _placeholder(model: torch.nn.Module, kind: str) -> int:
    return int(getattr(model.config, f"{kind}_token_id"))


def test_the_items_placeholders_sit_in_the_environment_turn_with_their_token_count(run) -> None:  # type: ignore[no-untyped-def]
    episodes, model, _ = run
    grids = {"image": "image_grid_thw", "video": "video_grid_thw"}
    for ep in episodes:
        [(kind, start, length)] = ep.media_spans
        # Hand-derived counts: a 56×56 image is (1, 4, 4) patches / 2² = 4 tokens; 4 frames at temporal patch 2 are
        # (2, 4, 4) / 2² = 8; 1 s of audio is 100 mel frames → ((100 − 1)//2 + 1 − 2)//2 + 1 = 25 tokens.
        assert length == {"image": 4, "video": 8, "audio": 25}[kind]
        if kind in grids:
            assert int(ep.media[grids[kind]].prod()) // 4 == length
        ids = ep.token_ids
        assert ids[start : start + length] == [_placeholder(model, kind)] * length
        assert ids[start - 1] != _placeholder(model, kind) and ids[start + length] != _placeholder(model, kind)
        assert ep.mask[start - 1 : start + length + 1] == [0] * (length + 2)  # the environment's, never trained
        assert sum(i == _placeholder(model, kind) for i in ids) == length  # none elsewhere
        assert not ep.prompt_media  # the item came with turn 2, not with reset
        completion = ep.to_completion()
        assert completion.media_spans == ep.media_spans and completion.media.keys() == ep.media.keys()
        assert ep.sample_prompt().media().keys() == ep.media.keys()
        assert ep.counters.turns == 2 and 0 < ep.mask.index(0) < start  # turn 1 was sampled before the item


def _tolerance(model: torch.nn.Module, max_len: int, max_abs_logit: float) -> float:
    """First-order float32 rounding bound of a log-prob (Higham, *Accuracy and Stability of Numerical Algorithms*,
    §3.1: a sum of k rounded terms is within k·u of exact relative to the sum of the terms' magnitudes). The longest
    chain of rounded operations a log-prob depends on: the media encoder's (per block the q/k/v/o projections, its
    MLP and the attention sum over its ≤ 128 positions, then its output projection) feeding the text decoder's,
    layers·(4H + I + T) + H + V (the projections, the MLP, the attention sum over T positions, the LM head, the
    log-sum-exp over V), each relative to magnitudes bounded by Λ = 2·max|logit| + log V: |Δ log p| ≤ K·u·(1 + Λ)."""
    cfg = model.config
    text = cfg.get_text_config()
    k = text.num_hidden_layers * (4 * text.hidden_size + text.intermediate_size + max_len)
    k += text.hidden_size + text.vocab_size
    vision, audio = cfg.vision_config, cfg.audio_config
    k += max(
        vision.depth * (4 * vision.hidden_size + vision.intermediate_size + 128) + 4 * vision.hidden_size,
        audio.encoder_layers * (4 * audio.d_model + audio.encoder_ffn_dim + 128) + 3 * audio.num_mel_bins,
    )
    lam = 2 * max_abs_logit + math.log(text.vocab_size)
    return k * U32 * (1 + lam)


def _forward_logprobs(
    reference: torch.nn.Module, ep: Episode, media: dict[str, torch.Tensor], suppressed: tuple[int, ...]
) -> tuple[torch.Tensor, float]:
    """``[L]`` float64 log-prob of each response token from one plain forward of the whole conversation (the model
    computes its own rope positions from the ids and the media), and the largest |logit|."""
    ids = torch.tensor(ep.prompt_ids + ep.token_ids)[None]  # [1, P + L]
    kwargs = {k: v.double() if v.is_floating_point() else v for k, v in media.items()}
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits[0]
    logits = logits[len(ep.prompt_ids) - 1 : -1]  # [L, V] predicting each response token
    scaled = logits / TEMPERATURE
    scaled[:, list(suppressed)] = -math.inf
    logp = torch.log_softmax(scaled, dim=-1)  # [L, V]
    return logp[torch.arange(len(ep.token_ids)), torch.tensor(ep.token_ids)], float(logits.abs().max())


def test_rollout_and_trainer_logprobs_equal_a_plain_forward_of_the_whole_conversation(run) -> None:  # type: ignore[no-untyped-def]
    episodes, model, suppressed = run
    reference = copy.deepcopy(model).double().eval()
    trainer = TorchTrainEngine(
        copy.deepcopy(model), TorchTrainConfig(temperature=TEMPERATURE, suppressed_ids=suppressed)
    )
    # Every sample as it comes out of the queue: its prompt (with the episode's media) pickled and back.
    samples = [
        TrainSample(pickle.loads(pickle.dumps(ep.sample_prompt())), torch.tensor(ep.token_ids)) for ep in episodes
    ]
    trained, trained_mask = trainer.compute_logprobs(samples)  # [B, L]: the Trainer's scoring path, batched
    for i, ep in enumerate(episodes):
        expected, max_logit = _forward_logprobs(reference, ep, ep.sample_prompt().media(), suppressed)
        policy = torch.tensor(ep.mask, dtype=torch.bool)
        n = len(ep.token_ids)
        tol = _tolerance(model, len(ep.prompt_ids) + n, max_logit / TEMPERATURE)
        rollout = torch.tensor(ep.logprobs, dtype=torch.float64)
        assert trained_mask[i, :n].bool()[policy].all()  # every policy token is scored
        assert float((rollout - expected)[policy].abs().max()) <= tol, (ep.media_spans, tol)
        assert float((trained[i, :n].double() - expected)[policy].abs().max()) <= tol, (ep.media_spans, tol)


def test_the_conversation_without_the_item_scores_the_tokens_after_it_differently(run) -> None:  # type: ignore[no-untyped-def]
    """The same tokens with the item's turn rendered without it (the tiny template renders a media part as its
    markers around the placeholders, so that conversation is the ids without the marker-placeholder-marker run):
    the tokens before the item score the same to float64 rounding, the assistant tokens after it differ from the
    rollout's by more than twice the rounding bound, so the rollout saw the item where it was."""
    episodes, model, suppressed = run
    reference = copy.deepcopy(model).double().eval()
    for ep in episodes:
        kind, start, length = ep.media_spans[0]
        seen, max_logit = _forward_logprobs(reference, ep, ep.sample_prompt().media(), suppressed)
        keep = [j for j in range(len(ep.token_ids)) if not start - 1 <= j <= start + length]
        text_only = Episode(prompt_ids=ep.prompt_ids, token_ids=[ep.token_ids[j] for j in keep])
        unseen, _ = _forward_logprobs(reference, text_only, {}, suppressed)
        before = [k for k, j in enumerate(keep) if j < start - 1 and ep.mask[j] == 1]
        after = [k for k, j in enumerate(keep) if j > start and ep.mask[j] == 1]
        assert after, "a second assistant turn follows the item"
        rollout = torch.tensor(ep.logprobs, dtype=torch.float64)
        tol = _tolerance(model, len(ep.prompt_ids) + len(ep.token_ids), max_logit / TEMPERATURE)
        assert float((seen[[keep[k] for k in before]] - unseen[before]).abs().max()) <= 1e-12
        assert float((rollout[[keep[k] for k in after]] - unseen[after]).abs().max()) > 2 * tol, kind


TOOL_ENV = """
class Tools:
    modalities = ("image", "video")

    def reset(self, row):
        return [{"role": "user", "content": row["q"]}]

    def look(self, what: str) -> list:
        '''Shows a picture of something.

        Args:
            what: What to look at.
        '''
        return [{"type": "text", "text": "here is " + what + ":"}, {"type": "image", "image": FILE}]

    def broken(self) -> dict:
        '''Shows a picture that is not one.'''
        return {"type": "image", "image": b"not an image at all"}

    def noise(self) -> dict:
        '''Plays a sound (the environment does not declare audio).'''
        return {"type": "audio", "audio": FILE}
"""

TOOL_SCRIPTS = {
    "a": ['<tool_call>{"name": "look", "arguments": {"what": "a cat"}}</tool_call>', "a cat"],
    "b": ['<tool_call>{"name": "broken", "arguments": {}}</tool_call>', "nothing"],
    "c": ['<tool_call>{"name": "noise", "arguments": {}}</tool_call>', "silence"],
}


def _tool_run(tmp_path: Path, scripted_engine, write_env):  # type: ignore[no-untyped-def]
    from relax_services.models.tiny_tokenizer import build_tiny_tokenizer

    from .conftest import PRINTABLE_EXTRA

    files = _files(tmp_path)
    env = write_env(TOOL_ENV.replace("FILE", repr(files["image"])), "Tools")
    ckpt = open_checkpoint(DEFAULT_SOURCE)
    # The tiny model's tokenizer and template (media parts render as their placeholder for any role), with every
    # printable character so that the scripted turns can write Qwen's <tool_call> JSON.
    tok = build_tiny_tokenizer(PRINTABLE_EXTRA)

    def script(prompt: str) -> str:
        row = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        return TOOL_SCRIPTS[row][prompt.count("<|im_start|>assistant\n") - 1]

    engine = scripted_engine(tok, script)
    params = SamplingParams(eos_id=tok.eos_token_id, max_new_tokens=200)
    config = AgentConfig(max_turns=3, max_new_tokens=200, max_episode_tokens=1000)
    with EpisodeRunner(engine, env, tok, ckpt.family, params, config, EpisodeMedia.of_checkpoint(ckpt)) as runner:
        groups = runner.run_sync([{"q": q} for q in TOOL_SCRIPTS])
    return [g[0] for g in groups], engine, ckpt, files


def test_a_tools_image_reaches_the_next_prompt_through_the_dataset_rows_data_path(
    tmp_path: Path, scripted_engine, write_env
) -> None:  # type: ignore[no-untyped-def]
    from relax_modalities import process_sample
    from relax_services.data.prompts import processor_settings

    (look, _, _), engine, ckpt, files = _tool_run(tmp_path, scripted_engine, write_env)
    assert (look.finish_reason, look.counters.tool_calls, look.counters.tool_errors) == ("stop", 1, 0)
    [(kind, start, length)] = look.media_spans
    assert (kind, length) == ("image", 4)
    image_id = ckpt.tokens.placeholders["image"]
    second = engine.prompts[1][0]  # the prompt of turn 2: the first prompt, turn 1 and the tool's turn
    offset = len(look.prompt_ids)
    assert second[offset + start - 1 : offset + start + length + 1] == [
        ckpt.tokens.placeholders["vision_start"],
        *[image_id] * 4,
        ckpt.tokens.placeholders["vision_end"],
    ]
    assert second.count(image_id) == 4
    # The pixels are the single-turn data path's for the same file (a dataset row's image).
    row = process_sample(
        {"prompt": "x", "media": [{"modality": "image", "path": files["image"]}]},
        ckpt.tokenizer,
        processor_settings(ckpt),
    )
    media = engine.media[1][0]
    assert torch.equal(media["pixel_values"], row["pixel_values"])
    assert torch.equal(media["image_grid_thw"], row["image_grid_thw"])
    assert torch.equal(look.to_completion().media["pixel_values"], row["pixel_values"])
    assert not engine.media[0][0]  # turn 1 had none


def test_media_a_tool_returns_that_cannot_be_read_are_a_tool_error_the_model_sees(
    tmp_path: Path, scripted_engine, write_env
) -> None:  # type: ignore[no-untyped-def]
    import json

    (_, broken, noise), _, _, _ = _tool_run(tmp_path, scripted_engine, write_env)
    for ep, why in (
        (broken, "tool 'broken' returned media that cannot be read: MediaError"),
        (noise, "tool 'noise' returned media that cannot be read: UnsupportedMediaError: tool 'noise' returned audio"),
    ):
        assert (ep.finish_reason, ep.counters.turns, ep.counters.tool_errors) == ("stop", 2, 1), ep.error
        assert not ep.media_spans and not ep.media
        [tool] = [m for m in ep.messages if m["role"] == "tool"]
        assert json.loads(str(tool["content"]))["error"].startswith(why), tool


def test_a_family_that_cannot_take_a_declared_modality_is_refused_at_start(tmp_path: Path, write_env) -> None:
    from relax_services.agents import UnsupportedMediaError
    from relax_services.models import FAMILIES

    ckpt = open_checkpoint(DEFAULT_SOURCE)
    env = write_env(TOOL_ENV.replace("FILE", "'x.png'").replace('("image", "video")', '("image", "audio")'), "Tools")
    vl = FAMILIES["Qwen2_5_VLForConditionalGeneration"]
    reader = EpisodeMedia.of_checkpoint(ckpt)
    vl_reader = EpisodeMedia(reader.processor, vl.name, vl.modalities)
    params = SamplingParams(eos_id=ckpt.tokens.eos_id)
    with pytest.raises(UnsupportedMediaError, match=r"family qwen2\.5-vl cannot take audio"):
        EpisodeRunner(object(), env, ckpt.tokenizer, vl, params, media=vl_reader)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedMediaError, match="reads no media"):
        EpisodeRunner(object(), env, ckpt.tokenizer, ckpt.family, params)  # type: ignore[arg-type]
    reader.close()
    vl_reader.close()
