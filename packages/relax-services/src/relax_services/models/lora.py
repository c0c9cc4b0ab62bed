"""Low-rank adapters on a policy (``model.lora``), through peft's LoRA layers injected into the model itself: the
model keeps its class and attributes (``lm_head``, ``config``), only its target linear layers become peft's
``lora.Linear`` (the frozen layer as ``base_layer`` plus ``lora_A`` / ``lora_B``).

Three views of an adapted model:

- :func:`merged_state`: the plain model's state dict (its own names) with every adapted weight replaced by
  ``W + (alpha / rank) · B A``: what rollout engines, the Reference and the Hugging Face export receive.
- :func:`adapter_state` / :func:`load_adapter_state`: the adapters alone, what a checkpoint holds.
- :func:`save_adapter`: the adapters in peft's folder format (``adapter_config.json``, ``adapter_model.safetensors``),
  which ``peft.PeftModel.from_pretrained`` loads over the base model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from peft import LoraConfig as PeftLoraConfig
    from peft.tuners.lora import Linear as LoraLinear

    from relax_services.config import LoraConfig

__all__ = [
    "ADAPTER_FOLDER",
    "adapter_names",
    "adapter_state",
    "apply_lora",
    "linear_names",
    "load_adapter_state",
    "merge_adapters",
    "merged_state",
    "peft_config",
    "save_adapter",
]

ADAPTER_FOLDER = "adapter"
"""Name of the adapter's folder (peft's format) inside a Hugging Face export."""

_ADAPTER = "default"  # peft's adapter name; one adapter per model


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct own names (last part of the dotted path) of ``model``'s ``nn.Linear`` layers, sorted."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def peft_config(cfg: LoraConfig) -> PeftLoraConfig:
    """peft's LoRA config for ``model.lora`` (targets matched by a layer's own name, as peft matches a list)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules)
    )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """Injects adapters into ``model`` in place and freezes every other parameter.

    ``A`` is drawn from torch's global RNG (peft's Kaiming-uniform init), ``B`` is zero: seed first for the same
    adapters in every process.

    Returns:
        ``model`` itself (same class), its only trainable parameters the adapters'.

    Raises:
        ValueError: A target name the model has no linear layer of (naming the ones it has), or dropout on the LM
            head (the chunked scoring recomputes the head in the backward without replaying its dropout mask).
    """
    from peft import inject_adapter_in_model
    from transformers import PreTrainedModel

    names = linear_names(model)
    unknown = [t for t in cfg.target_modules if t not in names]
    if unknown:
        raise ValueError(
            f"model.lora.target_modules: {unknown} name no linear layer of the model "
            f"({type(model).__name__}); its linear layers are named {names}"
        )
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None  # type: ignore[no-untyped-call]
    if cfg.dropout > 0 and any(m is head for m in _targets(model, cfg)):
        raise ValueError(
            f"model.lora.dropout={cfg.dropout} with the LM head among model.lora.target_modules: the chunked "
            "scoring recomputes the head in the backward without replaying its dropout; use dropout 0 or leave "
            "the head out"
        )
    adapted = inject_adapter_in_model(peft_config(cfg), model, adapter_name=_ADAPTER)
    assert adapted is model, "peft injects in place"
    return model


def _targets(model: torch.nn.Module, cfg: LoraConfig) -> list[torch.nn.Module]:
    wanted = set(cfg.target_modules)
    return [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in wanted]


def _lora_layers(model: torch.nn.Module) -> dict[str, LoraLinear]:
    """Dotted name → peft LoRA layer of ``model`` (linear ones: :func:`apply_lora` targets linear layers only)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert all(isinstance(m, LoraLinear) for m in layers.values()), "adapters on linear layers only"
    return {name: m for name, m in layers.items() if isinstance(m, LoraLinear)}


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the plain model's weights with the adapters merged in, under the plain model's names.

    Each adapted layer's ``{name}.base_layer.weight`` becomes ``{name}.weight`` = ``W + (alpha / rank) · B A``
    (peft's ``get_delta_weight``); its other base tensors (the bias) keep their values and lose ``base_layer``;
    the adapter tensors are left out. The live model is not changed (merging in place and back would not give
    the frozen weights' bits back).
    """
    with torch.no_grad():
        state = {k: v.detach() for k, v in model.state_dict().items()}
        return {k: v.to("cpu", copy=True) for k, v in _merged(_lora_layers(model), state)}


def merge_adapters(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`merged_state` of full tensors given under ``model``'s own (adapted) state-dict names, e.g. gathered
    from a sharded ``model``: ``model`` supplies the adapted layers and their scaling, ``state`` every value. The same
    arithmetic as :func:`merged_state`, so the same tensors give the same bits; unchanged tensors are ``state``'s own.
    """
    with torch.no_grad():
        return dict(_merged(_lora_layers(model), state))


def _merged(layers: Mapping[str, LoraLinear], state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(plain name, value)`` of ``state`` with each adapted weight merged and the adapter tensors left out."""
    for key, value in state.items():
        layer_name = _owning_layer(key.rpartition(".")[0], layers)
        if layer_name is None:
            yield key, value
            continue
        part, _, tail = key[len(layer_name) + 1 :].partition(".")
        if part != "base_layer":
            continue  # lora_A / lora_B / dropout: adapter tensors
        if tail != "weight":
            yield f"{layer_name}.{tail}", value
            continue
        delta = _delta_weight(layers[layer_name], state, layer_name)  # [out, in]
        yield f"{layer_name}.weight", value + delta.to(value.dtype)


def _delta_weight(layer: LoraLinear, state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """``(alpha / rank) · B A`` of adapted layer ``name`` from ``state``'s tensors, as peft's ``get_delta_weight``
    computes it from the layer's own (half precision on the CPU through float32)."""
    a = state[f"{name}.lora_A.{_ADAPTER}.weight"]  # [rank, in]
    b = state[f"{name}.lora_B.{_ADAPTER}.weight"]  # [out, rank]
    dtype = b.dtype
    half_on_cpu = b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if half_on_cpu:
        a, b = a.float(), b.float()
    product = b @ a
    scaling = float(layer.scaling[_ADAPTER])
    delta = (product.T if layer.fan_in_fan_out else product) * scaling
    return delta.to(dtype) if half_on_cpu else delta


def _owning_layer(owner: str, layers: Mapping[str, object]) -> str | None:
    """The name of the LoRA layer whose subtree holds module ``owner`` (a tensor's owner), or None."""
    parts = owner.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in layers:
            return prefix
    return None


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the adapters' parameters (the trainable ones), under the adapted model's names."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def adapter_names(model: torch.nn.Module) -> list[str]:
    """Names of the adapters' parameters (the trainable ones) of an adapted ``model``, in parameter order."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def load_adapter_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copies :func:`adapter_state` ``state`` into ``model``'s adapters.

    Raises:
        ValueError: If the names differ from the model's adapters (a checkpoint of another ``model.lora``).
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(state):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(
            f"the adapter state does not match the model's adapters (model.lora changed since it was saved?): "
            f"missing {missing[:4]}{'…' if len(missing) > 4 else ''}, unexpected {extra[:4]}"
            f"{'…' if len(extra) > 4 else ''}"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])


def save_adapter(
    model: torch.nn.Module,
    cfg: LoraConfig,
    folder: str | Path,
    base_path: str | Path,
    state: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Writes ``model``'s adapters to ``folder`` in peft's format, ``base_path`` recorded as the base model.

    ``state``: the adapters' full tensors under ``model``'s names (:func:`adapter_state`, or gathered from the shards
    of a sharded ``model``); None reads ``model``'s own.

    Returns:
        ``folder``.
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(cfg)
    config.base_model_name_or_path = str(base_path)
    config.save_pretrained(str(out))
    # peft's own key layout (adapter name dropped), under the prefix PeftModel gives the wrapped model
    weights = get_peft_model_state_dict(model, state_dict=None if state is None else dict(state), adapter_name=_ADAPTER)
    save_file(
        {f"base_model.model.{k}": v.detach().cpu().contiguous() for k, v in weights.items()},
        str(out / "adapter_model.safetensors"),
    )
    return out
