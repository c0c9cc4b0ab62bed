"""The text decoder of a Qwen2.5-Omni thinker as a Qwen2 causal-LM checkpoint that vLLM loads.

The thinker's text decoder is a Qwen2 decoder with multimodal rope. On a text-only prompt the three rope
components (time, height, width) all equal the token index, and multimodal rope then equals plain rope, so a
``Qwen2ForCausalLM`` holding the thinker's ``model.*`` and ``lm_head`` weights computes the same logits (a test
checks it to float equality). Its parameter names are the thinker's own, so a trainer's state dict streams into
vLLM unchanged once the encoder weights (``visual.*``, ``audio_tower.*``) are left out. This module needs
transformers only, not vLLM.

A policy trained with ``model.lora`` can instead reach vLLM as its adapters alone (``rollout.vllm.lora_requests``):
:func:`write_peft_adapter` turns the trainer's adapter tensors into the peft folder vLLM's ``LoRARequest`` loads.
"""

from __future__ import annotations

import json
import re
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


_ADAPTER_KEY = re.compile(r"^(?P<layer>.+)\.lora_(?P<part>[AB])\.[^.]+\.weight$")
"""An adapter tensor under the adapted model's names: ``{layer}.lora_A.{adapter name}.weight`` (peft's layout)."""


def is_adapter_key(name: str) -> bool:
    """Whether ``name`` is an adapter tensor of a peft-adapted model (``{layer}.lora_A|lora_B.{adapter}.weight``)."""
    return _ADAPTER_KEY.match(name) is not None


def write_peft_adapter(
    state: Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    rank: int,
    alpha: int,
    skip_prefixes: tuple[str, ...] = ENCODER_PREFIXES,
    base_path: str | Path | None = None,
) -> Path:
    """Writes adapter tensors as a peft LoRA folder (``adapter_config.json``, ``adapter_model.safetensors``), the form
    ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load over the base model.

    Args:
        state: ``{layer}.lora_A.{adapter}.weight`` (``[rank, in]``) and ``{layer}.lora_B.{adapter}.weight``
            (``[out, rank]``) tensors under the adapted model's names, as
            :func:`~relax_services.models.lora.adapter_state` gives them; the update of each layer is
            ``(alpha / rank) · B A``.
        folder: Folder to write; created if missing.
        rank: The adapters' rank ``r`` (``model.lora.rank``).
        alpha: Scale numerator (``model.lora.alpha``).
        skip_prefixes: Layers left out (the omni encoders a text-decoder export has no place for).
        base_path: Recorded as the base model (peft's ``base_model_name_or_path``).

    Returns:
        ``folder``.

    Raises:
        ValueError: A tensor that is not an adapter tensor, a layer with only one of ``A`` / ``B``, a shape that does
            not fit ``rank``, or no adapter left after ``skip_prefixes``.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    parts: dict[str, set[str]] = {}
    for name, tensor in state.items():
        match = _ADAPTER_KEY.match(name)
        if match is None:
            raise ValueError(
                f"write_peft_adapter: {name!r} is not an adapter tensor ({{layer}}.lora_A|lora_B.*.weight)"
            )
        layer, part = match["layer"], match["part"]
        if layer.startswith(skip_prefixes):
            continue
        dim = 0 if part == "A" else 1
        if tensor.ndim != 2 or tensor.shape[dim] != rank:
            raise ValueError(
                f"write_peft_adapter: {name} has shape {tuple(tensor.shape)}, expected rank {rank} in dimension {dim}"
            )
        parts.setdefault(layer, set()).add(part)
        # peft's file layout: the adapter name dropped, under the prefix PeftModel gives the wrapped model
        tensors[f"base_model.model.{layer}.lora_{part}.weight"] = tensor.detach().to("cpu").contiguous()
    lonely = sorted(layer for layer, p in parts.items() if p != {"A", "B"})
    if lonely:
        raise ValueError(f"write_peft_adapter: layers with only one of lora_A / lora_B: {lonely[:4]}")
    if not tensors:
        raise ValueError(f"write_peft_adapter: no adapter tensors outside {skip_prefixes} among {len(state)} given")
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None if base_path is None else str(base_path),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({layer.rsplit(".", 1)[-1] for layer in parts}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
