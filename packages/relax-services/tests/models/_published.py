"""Checkpoint folders made from published checkpoints' configuration files (``tests/fixtures/published/<name>``).

Each fixture folder holds a published checkpoint's config, processor, tokenizer and generation files as its
publisher ships them, with only the weight sizes of ``config.json`` shrunk (``SOURCES.md`` there says which fields
and where each file's content comes from). The two files too large to keep are made here: ``tokenizer.json``, a
byte-level BPE over the 256 byte symbols (no merges, so every byte is one token; the other ids below the added
tokens are unreachable fillers) with the added tokens of ``tokenizer_config.json`` at their published ids, and the
weights, random, from the shrunk ``config.json`` (written beside it, the config file left as published).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import safetensors.torch
import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode

FIXTURES = Path(__file__).parent / "fixtures" / "published"

# Qwen2's pre-tokenisation (transformers' Qwen2Tokenizer rebuilds the same one around the vocabulary it is given).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _tokenizer_json(added: dict[str, dict[str, object]]) -> Tokenizer:
    first = min(int(i) for i in added)
    symbols = list(bytes_to_unicode().values())  # the 256 byte-level symbols
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({f"<filler {i}>": i for i in range(len(symbols), first)})  # never produced: no merges lead there
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    for index in sorted(added, key=int):
        entry = added[index]
        token = AddedToken(str(entry["content"]), special=bool(entry["special"]), normalized=False)
        backend.add_tokens([token])
        if backend.token_to_id(str(entry["content"])) != int(index):
            raise AssertionError(f"added token {entry['content']!r} did not land on its published id {index}")
    return backend


def published_folder(name: str, dest: Path, seed: int = 0) -> Path:
    """A complete checkpoint folder at ``dest`` from the fixture ``name``."""
    source = FIXTURES / name
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix == ".json":
            shutil.copy2(f, dest / f.name)
    added = json.loads((source / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    _tokenizer_json(added).save(str(dest / "tokenizer.json"))
    config = transformers.AutoConfig.from_pretrained(dest, local_files_only=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, config.architectures[0])(config)
    model = model.to(torch.bfloat16)  # the published weights' dtype; half the bytes of the 151936-row embedding
    safetensors.torch.save_model(model, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest
