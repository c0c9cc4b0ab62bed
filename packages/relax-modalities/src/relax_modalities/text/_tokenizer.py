"""Tokenizer protocol and the tiny character tokenizer (plain Python, `tokenizers` and transformers forms)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from relax_modalities.text._vocab import CHARACTERS, SPECIAL_TOKENS, TINY_VOCAB, TinyVocab

if TYPE_CHECKING:
    import tokenizers


@runtime_checkable
class Tokenizer(Protocol):
    """What the chat builder and the data pipeline need from a tokenizer.

    A transformers ``PreTrainedTokenizerFast`` satisfies it structurally, and so does `TinyTokenizer`.
    """

    @property
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must hold."""
        ...

    def encode(self, text: str) -> list[int]:
        """Encode text (special token strings inside it map to their ids) to ids."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Decode ids back to text."""
        ...

    def convert_tokens_to_ids(self, tokens: str) -> int:
        """Id of one token string (used for special tokens)."""
        ...


class TokenizationError(ValueError):
    """Raised by `TinyTokenizer` when text holds characters outside the vocabulary."""


class TinyTokenizer:
    """Character-level tokenizer over the 64-token `TinyVocab`, in plain Python.

    Special token strings (``<|bos|>`` …) in the text are matched whole; every other character is
    one token. The vocabulary has no unknown token, so a character outside it raises
    `TokenizationError`. Fast for millions of short prompts, deterministic and dependency-free.
    """

    _SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

    def __init__(self) -> None:
        self.vocab: TinyVocab = TINY_VOCAB
        self._id_of: dict[str, int] = {t: i for i, t in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
        self._token_of: list[str] = [*SPECIAL_TOKENS, *CHARACTERS]
        self._n_special = len(SPECIAL_TOKENS)

    @property
    def vocab_size(self) -> int:
        """64."""
        return len(self._token_of)

    @property
    def pad_token_id(self) -> int:
        """Id of the pad token."""
        return self.vocab.pad_id

    @property
    def eos_token_id(self) -> int:
        """Id of the eos token (``<|eos|>``)."""
        return self.vocab.eos_id

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        """Encode ``text``; special token strings are single ids, every other character one id.

        Raises:
            TokenizationError: when a character is not in the vocabulary.
        """
        ids: list[int] = []
        for piece in self._SPECIAL_RE.split(text):
            if not piece:
                continue
            special = self._id_of.get(piece)
            if special is not None and special < self._n_special:
                ids.append(special)
                continue
            for ch in piece:
                i = self._id_of.get(ch)
                if i is None:
                    raise TokenizationError(
                        f"character {ch!r} in {text!r} is not in the tiny vocabulary "
                        f"(digits, a-z, A-E, space, newline and '+-*=?.,:!')"
                    )
                ids.append(i)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Decode ids to text; ``skip_special_tokens`` drops ids below the first character id."""
        out: list[str] = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"id {i} is outside the tiny vocabulary [0, {self.vocab_size})")
            if skip_special_tokens and i < self._n_special:
                continue
            out.append(self._token_of[i])
        return "".join(out)

    def convert_tokens_to_ids(self, tokens: str) -> int:
        """Id of one token string.

        Raises:
            KeyError: for a string that is not a single token of the vocabulary.
        """
        try:
            return self._id_of[tokens]
        except KeyError:
            raise KeyError(f"{tokens!r} is not a token of the tiny vocabulary") from None

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Token strings of ``ids``."""
        return [self._token_of[int(i)] for i in ids]

    def get_vocab(self) -> dict[str, int]:
        """Token string → id for all 64 tokens."""
        return dict(self._id_of)


def tiny_tokenizers_backend() -> tokenizers.Tokenizer:
    """Build the tiny vocabulary as a ``tokenizers.Tokenizer`` (WordLevel over single characters).

    Ids equal `TinyTokenizer`'s; special tokens are registered as added special tokens so they
    are matched whole and skipped by ``decode(..., skip_special_tokens=True)``. The vocabulary has no
    unknown token, so encoding a character outside it raises (``WordLevel error: Missing [UNK]``).
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _HFTokenizer

    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    # "<|unk|>" is not in the vocabulary, so encoding an unknown character raises.
    tok = _HFTokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    # `[\s\S]` (not `.`) so newline is a token too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tiny_hf_tokenizer() -> Any:
    """The tiny tokenizer as a transformers ``PreTrainedTokenizerFast`` (built locally, no hub access).

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with pad ``<|pad|>``, bos ``<|bos|>`` and eos
        ``<|eos|>``; it satisfies the `Tokenizer` protocol.

    Raises:
        ImportError: when transformers is not installed.
    """
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "tiny_hf_tokenizer needs transformers; install it (it is in the workspace dev group) "
            "or use relax_modalities.text.TinyTokenizer"
        ) from exc
    hf: Any = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tiny_tokenizers_backend(),
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
    )
    return hf
