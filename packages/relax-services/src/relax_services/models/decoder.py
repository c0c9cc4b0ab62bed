"""Token ids → text with the checkpoint's ``tokenizer.json`` read by the ``tokenizers`` library alone.

The Reward service decodes every response and runs no model: going through transformers' ``AutoTokenizer`` would
import transformers and torch into its process (hundreds of MB of memory and seconds of start-up) for this one
call. :class:`ResponseDecoder` gives the same text as ``AutoTokenizer.from_pretrained(folder).decode(ids,
skip_special_tokens=True)`` (tested against it): the same Rust tokenizer decodes, tokens marked special in
``tokenizer_config.json``'s ``added_tokens_decoder`` are special here too, and the ``clean_up_tokenization_spaces``
post-processing is applied under transformers' rule (never on a BPE model unless the config forces it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

__all__ = ["Decoder", "ResponseDecoder", "checkpoint_folder"]


class Decoder(Protocol):
    """What decoding a response needs of a tokenizer (a transformers tokenizer and :class:`ResponseDecoder`)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``."""
        ...


_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)
"""transformers' ``clean_up_tokenization`` replacements, in its order."""


def checkpoint_folder(source: str, seed: int = 0) -> Path:
    """The folder of ``model.source``: a path as given, or the default checkpoint's folder (resolving that one
    names the model's shape, which needs the model stack; a run's services get the warmed-up folder's path)."""
    from relax_services.config import ModelConfig

    if source != ModelConfig.model_fields["source"].default:
        return Path(source).expanduser().resolve()
    from relax_services.models.checkpoint import resolve_source

    return resolve_source(source, seed)


class ResponseDecoder:
    """Decodes token ids like the checkpoint's transformers tokenizer does, from its files alone.

    Args:
        folder: A checkpoint folder with ``tokenizer.json`` (and usually ``tokenizer_config.json``).

    Raises:
        FileNotFoundError: The folder has no ``tokenizer.json``.
    """

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import AddedToken, Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no tokenizer.json (the Reward service decodes responses with it)")
        self.backend = Tokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        # transformers re-adds the config's added tokens with their flags; a token special there is skipped here too.
        special = [
            AddedToken(entry["content"], special=True, normalized=entry.get("normalized", False))
            for entry in dict(config.get("added_tokens_decoder", {})).values()
            if entry.get("special")
        ]
        if special:
            self.backend.add_special_tokens(special)
        is_bpe = type(self.backend.model).__name__ == "BPE"
        forced = bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        self.clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (not is_bpe or forced)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (special tokens removed when ``skip_special_tokens``)."""
        text: str = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text
