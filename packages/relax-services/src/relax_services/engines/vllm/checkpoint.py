"""The text decoder of a Qwen2.5-Omni thinker as a Qwen2 causal-LM checkpoint that vLLM loads.

The thinker's text decoder is a Qwen2 decoder with multimodal rope. On a text-only prompt the three rope
components (time, height, width) all equal the token index, and multimodal rope then equals plain rope, so a
``Qwen2ForCausalLM`` holding the thinker's ``model.*`` and ``lm_head`` weights computes the same logits (a test
checks it to float equality). Its parameter names are the thinker's own, so a trainer's state dict streams into
vLLM unchanged once the encoder weights (``visual.*``, ``audio_tower.*``) are left out. This module needs
transformers only, not vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ENCODER_PREFIXES: tuple[str, ...] = ("visual.", "audio_tower.")
"""Thinker weights the text-only export has no place for."""


def text_decoder_weights(
    state_dict: Mapping[str, torch.Tensor], skip_prefixes: tuple[str, ...] = ENCODER_PREFIXES
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of the text decoder, in the state dict's order, encoders left out."""
    for name, tensor in state_dict.items():
        if not name.startswith(skip_prefixes):
            yield name, tensor


def _text_config(thinker: Any) -> Any:
    config = thinker.config
    return config.text_config if hasattr(config, "text_config") else config


def export_text_decoder(
    thinker: torch.nn.Module, path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None
) -> Path:
    """Writes ``thinker``'s text decoder as a ``Qwen2ForCausalLM`` checkpoint folder (``save_pretrained``).

    Args:
        thinker: A Qwen2.5-Omni thinker (or any model with a Qwen2-shaped ``text_config``).
        path: Folder to write; created if missing.
        tokenizer: Saved beside the weights when given (vLLM reads the vocabulary size and special ids from it);
            defaults to the tiny tokenizer of ``relax_modalities.text``.

    Returns:
        ``path``.

    Raises:
        ValueError: If the thinker's text decoder uses a rope other than plain rope per component, or its weights
            do not fill the Qwen2 model exactly.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    text = _text_config(thinker)
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"export_text_decoder: rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
    embed = thinker.get_input_embeddings().weight  # type: ignore[operator]
    head = thinker.get_output_embeddings().weight  # type: ignore[operator]
    config = Qwen2Config(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        hidden_act=text.hidden_act,
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=text.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 10000.0))},
        # The thinker config says "tied" in its text part but keeps a separate head; trust the tensors.
        tie_word_embeddings=embed.data_ptr() == head.data_ptr(),
        pad_token_id=text.pad_token_id,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        dtype=str(embed.dtype).removeprefix("torch."),
    )
    model = Qwen2ForCausalLM(config).to(embed.dtype)  # type: ignore[no-untyped-call]
    state = dict(text_decoder_weights(thinker.state_dict()))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"export_text_decoder: weights do not match Qwen2 (missing {missing}, unexpected {unexpected})"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer is None:
        from relax_modalities.text import tiny_hf_tokenizer

        tokenizer = tiny_hf_tokenizer()
    tokenizer.save_pretrained(path)
    return path


def chain_buckets(buckets: Iterable[Mapping[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Flattens a stream of weight buckets (name → tensor maps) into ``(name, tensor)`` pairs, lazily."""
    for bucket in buckets:
        yield from bucket.items()
