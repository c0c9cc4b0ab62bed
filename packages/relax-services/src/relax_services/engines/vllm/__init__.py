"""``rollout.engine=vllm``: the vLLM rollout engine built from the run config (registered in
:data:`~relax_services.engines.registry.ROLLOUT_ENGINES`).

The Rollout service and the Evaluator call the registered factory; vLLM loads the run's checkpoint folder
itself when its family is one vLLM serves as it is (Qwen2 / Qwen2.5, Qwen3, Qwen2.5-VL), and for the
Qwen2.5-Omni thinker the text decoder exported as a Qwen2 checkpoint (text prompts only; see
:mod:`~relax_services.engines.vllm.checkpoint`). Weight updates from the trainer then carry the policy's own
parameter names. Importing this module needs no vLLM; building an engine does.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from relax_services.config.devices import device_of, dtype_of, whole_gpus
from relax_services.engines.vllm.checkpoint import ENCODER_PREFIXES, export_text_decoder
from relax_services.engines.vllm.rollout import LogprobsMode, VLLMRolloutConfig, VLLMRolloutEngine, import_vllm
from relax_services.models.policy import build_policy, checkpoint_of

if TYPE_CHECKING:
    from relax_services.config import RunConfig
    from relax_services.engines.registry import RolloutEngineOptions

__all__ = ["NATIVE_FAMILIES", "build_vllm_rollout_engine", "vllm_config", "vllm_model_path"]

NATIVE_FAMILIES: tuple[str, ...] = ("qwen2", "qwen3", "qwen2.5-vl")
"""Families whose checkpoint folder vLLM loads as it is (their ``architectures`` entry is a vLLM model)."""

EXPORTED_FAMILIES: tuple[str, ...] = ("qwen2.5-omni-thinker",)
"""Families served through their text decoder exported as a Qwen2 checkpoint (text prompts only)."""


def vllm_config(cfg: RunConfig, options: RolloutEngineOptions, *, exported: bool) -> VLLMRolloutConfig:
    """The engine settings of ``cfg.rollout.vllm`` and the run's partial-rollout mode, sampling and seed, on the
    device of ``options.role`` (rollout or eval): on GPU the replica spans ``rollout.gpus`` devices (its
    tensor-parallel size unless set), its memory is ``gpu_memory_utilization`` of each and it captures CUDA graphs
    unless ``enforce_eager``; on the CPU its KV cache is ``kv_cache_mib`` and it runs eagerly. With
    ``lora_requests`` it serves ``model.lora``'s adapters as LoRA requests.

    Args:
        exported: The engine serves an exported text decoder, so the encoders' weights are left out of updates.
    """
    settings = cfg.rollout.vllm
    mode = options.partial_rollout if options.partial_rollout is not None else cfg.rollout.partial_rollout
    logprobs: LogprobsMode
    if settings.logprobs_mode == "auto":
        # processed_logprobs are taken after top-p truncation: only raw logits give the behaviour log-prob then.
        logprobs = "raw_logits" if cfg.rollout.top_p < 1 else "processed_logprobs"
    else:
        logprobs = settings.logprobs_mode
    gpu = device_of(cfg, options.role) == "cuda"
    lora = cfg.model.lora if settings.lora_requests else None  # the Trainer publishes adapters (publishes_adapters)
    tp = settings.tensor_parallel_size or (whole_gpus(cfg.rollout.gpus) if gpu else 1)
    return VLLMRolloutConfig(
        partial_rollout=mode,
        seed=cfg.trainer.seed,
        logprobs_mode=logprobs,
        tensor_parallel_size=tp,
        dtype=dtype_of(cfg, options.role) if settings.dtype == "auto" else settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        kv_cache_bytes=None if gpu else settings.kv_cache_mib * 1024**2,
        memory_fraction=settings.gpu_memory_utilization if gpu else VLLMRolloutConfig.memory_fraction,
        enforce_eager=not gpu if settings.enforce_eager is None else settings.enforce_eager,
        enable_prefix_caching=settings.enable_prefix_caching,
        sleep_when_idle=settings.sleep_when_idle and gpu,
        in_process=settings.in_process and tp == 1,
        skip_weight_prefixes=ENCODER_PREFIXES if exported else (),
        lora_rank=lora.rank if lora is not None else None,
        lora_alpha=lora.alpha if lora is not None else None,
    )


def vllm_model_path(cfg: RunConfig) -> tuple[Path, bool]:
    """The folder vLLM loads for the run's checkpoint, and whether it is an export (written to a temporary folder
    removed at exit).

    Raises:
        ValueError: The checkpoint's family has no vLLM path here.
    """
    checkpoint = checkpoint_of(cfg.model)
    family = checkpoint.family.name
    if family in NATIVE_FAMILIES:
        return checkpoint.path, False
    if family in EXPORTED_FAMILIES:
        folder = Path(tempfile.mkdtemp(prefix="relax-vllm-model-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return export_text_decoder(build_policy(cfg.model), folder, checkpoint.tokenizer), True
    known = ", ".join((*NATIVE_FAMILIES, *EXPORTED_FAMILIES))
    raise ValueError(
        f"rollout.engine='vllm': model.source {checkpoint.path} is a {family} checkpoint; vLLM serves {known}"
    )


def build_vllm_rollout_engine(cfg: RunConfig, options: RolloutEngineOptions) -> VLLMRolloutEngine:
    """``rollout.engine=vllm``: a vLLM engine on the run's checkpoint at version 0 (its weights are the
    trainer's initial ones), set by ``rollout.vllm``.

    Raises:
        ImportError: vLLM is not installed (the message names the extra ``relax-services[vllm]``).
        ValueError: The checkpoint's family has no vLLM path (:func:`vllm_model_path`).
    """
    import_vllm()  # fail before exporting anything
    path, exported = vllm_model_path(cfg)
    return VLLMRolloutEngine(path, vllm_config(cfg, options, exported=exported))
