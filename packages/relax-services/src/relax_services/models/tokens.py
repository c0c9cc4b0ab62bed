"""Token ids a run needs, read from a checkpoint (tokenizer, generation config, model config), never constants."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, SupportsInt

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = ["TokenIds", "model_pad_id", "token_ids_from"]


@dataclass(frozen=True)
class TokenIds:
    """The ids engines and data paths use.

    Attributes:
        vocab_size: Rows of the model's output layer (ids ``0 .. vocab_size − 1`` exist).
        pad_id: Fills padded positions (always masked out by the attention mask).
        eos_ids: Ids that end a response (the first is the one appended when a response is written).
        bos_id: Beginning-of-text id, ``None`` when the tokenizer has none.
        placeholders: Media placeholder and marker ids by role (``image``, ``video``, ``audio``,
            ``vision_start`` …), from the model config.
        never_sample: Ids a policy must never emit: the tokenizer's special tokens other than the eos ids, and
            every placeholder / marker id. Sampling them breaks the chat layout, and a placeholder in a response
            would be taken for media by the next forward. Sorted.
    """

    vocab_size: int
    pad_id: int
    eos_ids: tuple[int, ...]
    bos_id: int | None = None
    placeholders: Mapping[str, int] = field(default_factory=dict)
    never_sample: tuple[int, ...] = ()

    @property
    def eos_id(self) -> int:
        """The id a response ends with."""
        return self.eos_ids[0]

    def placeholder(self, role: str) -> int | None:
        """The id of a placeholder / marker role, ``None`` when the family has none."""
        return self.placeholders.get(role)


def _as_ids(value: int | Iterable[SupportsInt] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def token_ids_from(
    tokenizer: PreTrainedTokenizerBase,
    model_config: PretrainedConfig,
    generation_config: object,
    placeholder_keys: tuple[tuple[str, str], ...],
) -> TokenIds:
    """Reads every id from the checkpoint.

    eos: the generation config's ``eos_token_id`` (one or a list), else the tokenizer's; pad: the tokenizer's
    pad, else the generation config's, else the first eos. Placeholder ids come from the model config keys
    of the family (``placeholder_keys``, looked up on the config, then on its ``text_config``).

    Raises:
        ValueError: when no eos id can be found, or an id lies outside the vocabulary.
    """
    text_config = getattr(model_config, "text_config", None) or model_config
    vocab_size = int(text_config.vocab_size)
    eos = _as_ids(getattr(generation_config, "eos_token_id", None)) or _as_ids(tokenizer.eos_token_id)
    if not eos:
        raise ValueError("the checkpoint names no eos token (generation_config.json nor the tokenizer)")
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = getattr(generation_config, "pad_token_id", None)
    pad_id = int(pad) if pad is not None else eos[0]
    bos = tokenizer.bos_token_id
    placeholders: dict[str, int] = {}
    for role, key in placeholder_keys:
        value = getattr(model_config, key, None)
        if value is None:
            value = getattr(text_config, key, None)
        if value is not None:
            placeholders[role] = int(value)
    special = {int(i) for i in tokenizer.all_special_ids}
    special |= {int(i) for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    never = (special | set(placeholders.values())) - set(eos)
    for name, ids in (("eos", eos), ("pad", (pad_id,)), ("placeholder", tuple(placeholders.values()))):
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"{name} id(s) {bad} lie outside the model's vocabulary of {vocab_size}")
    return TokenIds(
        vocab_size=vocab_size,
        pad_id=pad_id,
        eos_ids=eos,
        bos_id=None if bos is None else int(bos),
        placeholders=placeholders,
        never_sample=tuple(sorted(i for i in never if i < vocab_size)),
    )


def model_pad_id(model: object) -> int:
    """The fill id of padded positions for a loaded model: its generation config's pad, else its (first) eos.

    The value never reaches a real position (the attention mask excludes it); it only has to be an id that is no
    media placeholder, which a checkpoint's pad / eos never is.

    Raises:
        ValueError: when the model's generation config names neither.
    """
    generation = getattr(model, "generation_config", None)
    for value in (getattr(generation, "pad_token_id", None), getattr(generation, "eos_token_id", None)):
        ids = _as_ids(value)
        if ids:
            return ids[0]
    raise ValueError(f"{type(model).__name__}'s generation config names no pad_token_id or eos_token_id")
