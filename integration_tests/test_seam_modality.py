"""A toy modality added through the modality seam: one module's worth of code per package it touches.

"points" is a ``.npy`` file of ``[n, 4]`` float32 rows, one placeholder token per row, encoded by a linear layer.
Its relax-modalities side (`PointsPath`: its settings type and dataset column, loading, processing to forward
kwargs, packing, cost) and its relax-services side (`PointsModality`: the prompt's fields, placeholder check,
collation, encoder call, position rule and token type, its settings read from a checkpoint folder) are each one
class, registered with one dict entry per package (``MODALITY_PATHS``, ``MODEL_MODALITIES``).
Nothing else changes: the sample processor and its settings (``ProcessorSettings(points=...)``, and
``processor_settings`` of a checkpoint), the dataset reader (the ``points`` column and ``<points>`` marker of a
JSONL file, renamed by ``data.schema.media_keys.points``), the checkpoint chat template, `OmniPrompt`,
`check_placeholders`, `collate_media`, the shared-media embeddings, the rope positions, the trainer's scoring and
the built-in rollout engine take it as they are.
The checks compare against values computed here by hand (token layout, the mrope rule, the embedding scatter and
a plain forward of the model on those embeddings).
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from relax_modalities import (
    MODALITY_PATHS,
    MediaBundle,
    MediaError,
    PackedMedia,
    ProcessorSettings,
    RowSchema,
    SampleProcessor,
    build_stream,
    estimate_cost,
    pack_batch,
)
from relax_modalities.synthetic import MediaRef
from relax_modalities.text import CheckpointTemplate, MediaSlot
from relax_services.data.run_data import processor_settings
from relax_services.engines import HFRolloutConfig, HFRolloutEngine, SamplingParams
from relax_services.engines.scoring import score_responses
from relax_services.models import (
    MODEL_MODALITIES,
    Checkpoint,
    OmniPrompt,
    check_placeholders,
    collate_media,
    token_ids_from,
)
from relax_services.models.checkpoint import _placeholder_keys
from relax_services.models.embeddings import embed_inputs
from relax_services.models.families import family_of_model
from relax_services.models.positions import sequence_positions
from relax_services.models.tiny_omni import TinyOmniConfig
from relax_services.models.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer

DIM = 4


# ---- relax-modalities side: the toy's ModalityPath (one module's worth) --------------------------------------
@dataclass(frozen=True)
class PointsSettings:
    """How a points file is read.

    Attributes:
        scale: every coordinate is multiplied by it (a unit conversion).
        max_rows: files with more rows are refused.
    """

    scale: float = 1.0
    max_rows: int = 64


class PointsPath:
    """``.npy`` rows → ``point_values [Σ rows, 4]`` (times `PointsSettings.scale`) and ``point_counts [n_items]``;
    one token per row. Its dataset column is ``points``."""

    name: str = "points"
    keys: tuple[str, ...] = ("point_values", "point_counts")
    column: str = "points"
    default_settings: PointsSettings = PointsSettings()

    def process(self, ref: MediaRef, settings: ProcessorSettings, media: MediaBundle) -> None:
        own = settings.of("points", PointsSettings)
        rows = np.load(ref.path)
        if rows.ndim != 2 or rows.shape[1] != DIM or not 1 <= len(rows) <= own.max_rows:
            raise MediaError(ref.path, "points", f"points must be [1..{own.max_rows}, {DIM}], got {list(rows.shape)}")
        media.add("points", torch.from_numpy(rows.astype(np.float32)) * own.scale)
        media.slots.append(MediaSlot("points", len(rows)))

    def model_inputs(self, items: Sequence[Any]) -> dict[str, torch.Tensor]:
        counts = torch.tensor([len(x) for x in items], dtype=torch.long)
        return {"point_values": torch.cat(list(items)), "point_counts": counts}

    def pack(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> PackedMedia:
        have = [(i, s) for i, s in enumerate(samples) if "point_counts" in s]
        owner = torch.tensor([i for i, s in have for _ in range(len(s["point_counts"]))], dtype=torch.long)
        counts = [s["point_counts"] for _, s in have]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat(counts).cumsum(0)]) if counts else None
        if not have:
            return PackedMedia({}, owner, torch.zeros(1, dtype=torch.long))
        inputs = {"point_values": torch.cat([s["point_values"] for _, s in have]), "point_counts": torch.cat(counts)}
        return PackedMedia(inputs, owner, offsets)

    def cost(self, sample: Mapping[str, torch.Tensor]) -> float:
        return float(sample["point_values"].shape[0]) if "point_values" in sample else 0.0


# ---- relax-services side: the toy's ModelModality (one module's worth) ---------------------------------------
class PointsModality:
    """The points' tensors in a prompt, their placeholders, collation and encoder (``model.points_encoder``)."""

    name: str = "points"
    fields: tuple[str, ...] = ("point_values", "point_counts")
    encoder_fields: tuple[str, ...] = ("point_values", "point_counts")
    position_fields: tuple[str, ...] = ()
    token_attr: str = "points_token_id"
    vl_token_type: int = 0  # positioned as text by the Qwen-VL rule too

    def processor_settings(self, config: object, preprocessor: Mapping[str, object]) -> PointsSettings | None:
        scale = preprocessor.get("points_scale")  # the checkpoint's preprocessor_config.json key
        return None if scale is None else PointsSettings(scale=float(str(scale)))

    def validate(self, media: Mapping[str, torch.Tensor]) -> None:
        values, counts = media.get("point_values"), media.get("point_counts")
        if values is None or counts is None or int(counts.sum()) != values.shape[0]:
            raise ValueError("OmniPrompt points: point_values rows must equal the sum of point_counts")

    def check_placeholders(self, n_tokens: int, media: Mapping[str, torch.Tensor]) -> None:
        expected = int(media["point_counts"].sum()) if media else 0
        if n_tokens != expected:
            raise ValueError(f"OmniPrompt has {n_tokens} points placeholder tokens but its rows need {expected}")

    def num_items(self, media: Mapping[str, torch.Tensor]) -> int:
        return len(media["point_counts"])

    def collate(self, parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {f: torch.cat([p[f] for p in parts]) for f in self.fields}

    def encode(self, model: Any, media: Mapping[str, torch.Tensor]) -> Sequence[torch.Tensor]:
        features = model.points_encoder(media["point_values"])  # [Σ rows, H]
        return torch.split(features, media["point_counts"].tolist())

    def structure(self, media: Mapping[str, torch.Tensor]) -> Hashable:
        return None if not media else tuple(media["point_counts"].tolist())

    def rope_args(self, positions: str, media: Mapping[str, torch.Tensor]) -> dict[str, object]:
        return {}  # positioned as text: one index per token


# ---- the test ------------------------------------------------------------------------------------------------
POINTS_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- elif part['type'] == 'text' -%}",
    "{%- elif part['type'] == 'points' -%}{{- '<|POINTS|>' -}}{%- elif part['type'] == 'text' -%}",
)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MODALITY_PATHS, "points", PointsPath())
    monkeypatch.setitem(MODEL_MODALITIES, "points", PointsModality())


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, np.ndarray]:
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((3, DIM)).astype(np.float32)
    np.save(tmp_path / "p.npy", rows)
    Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)).save(tmp_path / "i.png")
    return tmp_path / "p.npy", tmp_path / "i.png", rows


def _tokenizer_and_model() -> tuple[Any, Any]:
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    tok = build_tiny_tokenizer()
    tok.add_tokens(["<|POINTS|>"], special_tokens=True)  # id 64: the toy's placeholder
    tok.chat_template = POINTS_TEMPLATE
    torch.manual_seed(0)
    model = Qwen2_5OmniThinkerForConditionalGeneration(TinyOmniConfig().to_hf_config(tok)).eval()
    model.config.points_token_id = tok.convert_tokens_to_ids("<|POINTS|>")
    model.points_encoder = torch.nn.Linear(DIM, model.config.text_config.hidden_size)
    return tok, model


def test_a_toy_modality_runs_from_file_to_trainer_scores(
    registered: None, files: tuple[Path, Path, np.ndarray]
) -> None:
    points_file, image_file, rows = files
    tok, model = _tokenizer_and_model()
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (("points", "<|POINTS|>"), ("image", "<|IMAGE|>"))}
    assert ids["points"] == 64  # the one id added to the 64-token vocabulary

    # relax-modalities: the file is processed, rendered by the checkpoint's template and packed.
    settings = ProcessorSettings(template=CheckpointTemplate.of(ids))
    item = {
        "prompt": "1+2=",
        "media": [{"modality": "points", "path": str(points_file)}, {"modality": "image", "path": str(image_file)}],
    }
    kwargs = SampleProcessor(tok, settings)(item)
    assert torch.equal(kwargs["point_values"], torch.from_numpy(rows)) and kwargs["point_counts"].tolist() == [3]
    row = kwargs["input_ids"][0].tolist()
    head = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    vision = [tok.convert_tokens_to_ids(t) for t in ("<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>")]
    tail = tok.encode("1+2=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert row == head + [64] * 3 + [vision[0]] + [vision[1]] * 4 + [vision[2]] + tail  # 56×56 image: 4 tokens
    packed = pack_batch([kwargs, kwargs], padding_side="right", placeholder_ids=ids)
    assert packed.owners["points"].tolist() == [0, 1] and packed.offsets["points"].tolist() == [0, 3, 6]
    assert packed.placeholder_positions["points"].tolist() == [[b, len(head) + j] for b in (0, 1) for j in range(3)]
    assert estimate_cost(kwargs) == len(row) + 16 + 3  # tokens + 16 image patches + 3 point rows

    # relax-services: the prompt carries it, its placeholders are checked, its media collated.
    media = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")}
    prompt = OmniPrompt(kwargs["input_ids"][0], **media)
    # The checkpoint's ids, as a checkpoint folder is read: the points id comes from the modality's config key.
    tokens = token_ids_from(tok, model.config, model.generation_config, _placeholder_keys(family_of_model(model)))
    assert tokens.placeholder("points") == 64 and 64 in tokens.never_sample
    check_placeholders(prompt, tokens)
    with pytest.raises(ValueError, match="2 points placeholder tokens but its rows need 3"):
        check_placeholders(
            OmniPrompt(torch.tensor([64, 64, 12]), point_values=torch.zeros(3, DIM), point_counts=torch.tensor([3])),
            tokens,
        )
    copy = OmniPrompt(prompt.input_ids.clone(), **{k: v.clone() for k, v in prompt.media().items()})
    assert collate_media([prompt, copy])["point_counts"].tolist() == [3, 3]

    # Embeddings: the rows' features in the points placeholders, encoded once for the two copies.
    calls: list[int] = []
    model.points_encoder.register_forward_hook(lambda m, i, o: calls.append(len(i[0])))
    batch = torch.stack([prompt.input_ids, copy.input_ids])
    with torch.no_grad():
        embeds = embed_inputs(model, [prompt, copy], batch, "cpu")
        expected = model.get_input_embeddings()(batch).clone()
        expected[batch == 64] = model.points_encoder(torch.from_numpy(rows)).repeat(2, 1)
        image = model.get_image_features(media["pixel_values"], media["image_grid_thw"]).pooler_output[0]
        expected[batch == ids["image"]] = image.repeat(2, 1)
    assert calls == [3, 3]  # our reference call above is the second: embed_inputs encoded the rows once
    assert torch.equal(embeds, expected)

    # Positions: points are positioned as text; the image's 2×2 tokens by the mrope rule.
    positions, nxt = sequence_positions(model, [prompt], [2], side="right")
    k = len(head) + 3 + 1  # tokens before the image's first token
    by_hand = [[i, i, i] for i in range(k)]
    by_hand += [[k, k + h, k + w] for h in (0, 1) for w in (0, 1)]
    by_hand += [[i, i, i] for i in range(k + 2, k + 2 + 1 + len(tail) + 2)]
    assert positions[:, 0].T.tolist() == by_hand and int(nxt[0]) == by_hand[-1][0] + 1

    # The trainer's scoring of a response against a plain forward on the hand-built embeddings.
    response = torch.tensor([*tok.encode("3", add_special_tokens=False), tok.eos_token_id])
    with torch.no_grad():
        scores = score_responses(model, [prompt], [response])
        full = torch.cat([prompt.input_ids, response])[None]
        inputs = torch.cat([expected[:1], model.get_input_embeddings()(response)[None]], dim=1)
        logits = model(inputs_embeds=inputs, position_ids=positions, attention_mask=torch.ones_like(full)).logits
    reference = torch.log_softmax(logits[0, prompt.num_tokens - 1 : -1], -1).gather(-1, response[:, None])[:, 0]
    torch.testing.assert_close(scores.logprobs[0], reference, atol=1e-5, rtol=0)

    # The built-in rollout engine samples from it (the model's own forward takes no points: embedded first).
    engine = HFRolloutEngine(model, HFRolloutConfig(seed=0))
    for c in engine.generate([prompt], SamplingParams(n=2, max_new_tokens=3))[0]:
        tokens_out = torch.tensor(c.token_ids)
        seq_positions, _ = sequence_positions(model, [prompt], [len(tokens_out)], side="right")
        with torch.no_grad():
            inputs = torch.cat([expected[:1], model.get_input_embeddings()(tokens_out)[None]], dim=1)
            ones = torch.ones(inputs.shape[:2], dtype=torch.long)
            logits = model(inputs_embeds=inputs, position_ids=seq_positions, attention_mask=ones).logits[0]
        logp = torch.log_softmax(logits[prompt.num_tokens - 1 : -1], -1).gather(-1, tokens_out[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), logp, atol=1e-4, rtol=0)


def test_an_unregistered_modality_is_refused_by_name(files: tuple[Path, Path, np.ndarray]) -> None:
    points_file, _, _ = files
    tok, _ = _tokenizer_and_model()
    processor = SampleProcessor(tok, ProcessorSettings(template=CheckpointTemplate.of({"points": 64})))
    with pytest.raises(MediaError, match="unknown media modality 'points'"):
        processor({"prompt": "1", "media": [{"modality": "points", "path": str(points_file)}]})
    with pytest.raises(TypeError, match=r"\['point_values'\] that no registered modality owns"):
        OmniPrompt(torch.tensor([12]), point_values=torch.zeros(1, DIM))


def test_the_toys_settings_and_dataset_column_read_from_a_jsonl_file(
    registered: None, files: tuple[Path, Path, np.ndarray], tmp_path: Path
) -> None:
    points_file, image_file, rows = files
    tok, model = _tokenizer_and_model()
    tokens = token_ids_from(tok, model.config, model.generation_config, _placeholder_keys(family_of_model(model)))
    # A checkpoint folder as `open_checkpoint` reads it: the toy's setting comes from its preprocessor config.
    ckpt = Checkpoint(tmp_path, family_of_model(model), model.config, tok, tokens, {"points_scale": 2.0})
    settings = processor_settings(ckpt)
    assert settings.of("points", PointsSettings) == PointsSettings(scale=2.0)
    assert settings.image.patch_size == 14 and settings.video.vision == settings.image  # the built-ins' as before

    # A JSONL dataset in the row schema: the toy's column, its <points> marker beside an image's.
    data = tmp_path / "train.jsonl"
    row = {
        "data_source": "toy/points",
        "prompt": [{"role": "user", "content": "<points><image>1+2="}],
        "points": [points_file.name],
        "images": [image_file.name],
        "reward_model": {"ground_truth": "3"},
    }
    renamed = {**{k: v for k, v in row.items() if k != "points"}, "clouds": row["points"]}
    data.write_text(json.dumps(row) + "\n" + json.dumps(renamed) + "\n")
    first = next(build_stream([data], shuffle_buffer=0))
    assert [(m.kind, m.path) for m in first.media] == [("points", str(points_file)), ("image", str(image_file))]
    assert (first.data_source, first.ground_truth) == ("toy/points", "3")

    kwargs = SampleProcessor(tok, settings).process_record(first)
    assert torch.equal(kwargs["point_values"], torch.from_numpy(rows) * 2.0)  # the checkpoint's scale applied
    ids = kwargs["input_ids"][0].tolist()
    head = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    vision = [tok.convert_tokens_to_ids(t) for t in ("<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>")]
    tail = tok.encode("1+2=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert ids == head + [64] * 3 + [vision[0]] + [vision[1]] * 4 + [vision[2]] + tail
    media = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")}
    check_placeholders(OmniPrompt(kwargs["input_ids"][0], **media), tokens)

    # `data.schema.media_keys.points=clouds` reads the renamed column; the default schema finds no points there.
    stream = build_stream([data], RowSchema(media_keys={"points": "clouds"}), shuffle_buffer=0)
    records = list(stream)
    assert [r.row for r in records] == [1] and records[0].media == first.media
    assert stream.stats.total == 1  # row 0 has its points under "points", which this schema does not read
    assert stream.stats.recent[0].reason == "column 'prompt' message 0: more points placeholders than points items"

    # The toy's own setting bounds what it reads: a file over max_rows is this file's MediaError.
    strict = settings.with_modality("points", PointsSettings(max_rows=2))
    with pytest.raises(MediaError, match=r"points file .*p\.npy.*must be \[1\.\.2, 4\], got \[3, 4\]"):
        SampleProcessor(tok, strict).process_record(first)
